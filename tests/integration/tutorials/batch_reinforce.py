"""The batch-processing agent of "Implementing Batch RPC Processing Using Asynchronous
Executions" (pytorch/examples ``distributed/rpc/batch/reinforce.py``).

Rank 0 is the agent, the other ranks observers, each with a ``CartPole`` of its own. Each
episode, every observer runs a fixed number of steps (starting its pole again when it
falls) and asks the agent for each action. With ``--mode batch`` the agent's
``select_action_batch`` is an ``@rpc.functions.async_execution`` static method: each
observer's call stores its state and returns ``fut.then(...)`` on the step's shared future
(a bare ``torch._C.Future``, as ``then`` makes it), without holding a thread; the last
observer of the step runs the policy once on all the states and completes that future.
``--mode single`` answers each call at once. At the end of the episode the agent trains on
the returns the observers send back. Changes from the tutorial: CPU only; actions drawn
from generators of the agent's own (one for the batched step, one per observer when
single), and dropout only with one observer, so the result does not depend on how the
observers' calls interleave. With ``--full``, the upstream's lengths: one observer, 10
episodes of 500 steps, each mode (the test runs the program once per mode, as the upstream
spawns one job per mode).
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from tests.integration.tutorials.cartpole import CartPole
from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
    from torch.distributed.rpc import RRef, remote
else:
    import asyncrpc as rpc
    from asyncrpc import RRef, remote

AGENT_NAME, OBSERVER_NAME, GAMMA = "agent", "observer{}", 1.0
if full():
    OBSERVERS, EPISODES, NUM_STEPS, DROPOUT = 1, 10, 500, 0.6
else:
    OBSERVERS, EPISODES, NUM_STEPS, DROPOUT = 2, 3, 40, 0.0
MODES = ("batch", "single")


class Policy(nn.Module):
    def __init__(self, batch: bool) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(DROPOUT) if DROPOUT else nn.Identity()
        self.affine2 = nn.Linear(128, 2)
        self.dim = 2 if batch else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=self.dim)


class Observer:
    def __init__(self, batch: bool) -> None:
        self.id = rpc.get_worker_info().id - 1
        self.env = CartPole(seed=543)
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref: Any, n_steps: int) -> tuple[torch.Tensor, int]:
        """Run ``n_steps`` steps; return each step's return and the first pole's length."""
        state = self.env.reset()
        rewards = torch.zeros(n_steps)
        first_pole, start = n_steps, 0
        for step in range(n_steps):
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action,
                                  args=(agent_rref, self.id, state.unsqueeze(0)))  # fmt: skip
            state, reward, done, _ = self.env.step(action)
            rewards[step] = reward
            if done or step + 1 == n_steps:
                # Returns of this pole's steps, last first; the next pole starts afresh.
                ret = 0.0
                for i in range(step, start - 1, -1):
                    ret = float(rewards[i]) + GAMMA * ret
                    rewards[i] = ret
                if start == 0:
                    first_pole = step + 1
                state, start = self.env.reset(), step + 1
        return rewards, first_pole


class Agent:
    def __init__(self, world_size: int, batch: bool) -> None:
        self.agent_rref = RRef(self)
        self.batch = batch
        with seeded(0):
            self.policy = Policy(batch)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0.0
        self.ob_rrefs = [
            remote(OBSERVER_NAME.format(rank), Observer, args=(batch,))
            for rank in range(1, world_size)
        ]
        n = len(self.ob_rrefs)
        self.states = torch.zeros(n, 1, 4)
        # Batched: one tensor of every observer's log-prob a step. Single: a list each.
        self.saved_log_probs: list[torch.Tensor] = []
        self.single_log_probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.batch_generator = torch.Generator().manual_seed(1000)
        self.generators = [torch.Generator().manual_seed(1001 + i) for i in range(n)]
        self.future_actions: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = n

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref: Any, ob_id: int, state: torch.Tensor) -> Any:
        """Store the state; the step's last observer runs the policy for all of them."""
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(lambda fut: int(fut.wait()[ob_id].item()))
        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                # A copy, as the upstream's .cuda() makes one: the graph keeps its input,
                # and the next step writes into self.states.
                probs = self.policy(self.states.clone())
                actions = torch.multinomial(
                    probs.detach().flatten(0, 1), 1, generator=self.batch_generator
                ).view(-1, 1)
                self.saved_log_probs.append(Categorical(probs).log_prob(actions).t()[0])
                future_actions, self.future_actions = self.future_actions, torch.futures.Future()
                future_actions.set_result(actions)
        return future_action

    @staticmethod
    def select_action(agent_rref: Any, ob_id: int, state: torch.Tensor) -> int:
        """Run the policy on this observer's state alone and answer at once."""
        self = agent_rref.local_value()
        probs = self.policy(state)
        action = torch.multinomial(probs.detach(), 1, generator=self.generators[ob_id])[:, 0]
        self.single_log_probs[ob_id].append(Categorical(probs).log_prob(action)[0])
        return int(action.item())

    def run_episode(self, n_steps: int) -> tuple[float, float, torch.Tensor]:
        futs = [ob_rref.rpc_async().run_episode(self.agent_rref, n_steps)
                for ob_rref in self.ob_rrefs]  # fmt: skip
        rets = torch.futures.wait_all(futs)
        returns = torch.stack([ret[0] for ret in rets]).t()  # (steps, observers)
        ep_reward = sum(ret[1] for ret in rets) / len(rets)
        # The upstream sums every step's loss and calls backward once; we call it on each
        # step's own graph in the steps' order (see reinforce.backward_in_order for why).
        n = len(rets)
        if self.batch:
            terms = [
                -(lp * ret).sum() / n for lp, ret in zip(self.saved_log_probs, returns, strict=True)
            ]
        else:
            steps = zip(*self.single_log_probs, returns, strict=True)
            terms = [-lp * ret[o] / n for *lps, ret in steps for o, lp in enumerate(lps)]
        for term in terms:
            term.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.saved_log_probs = []
        self.single_log_probs = [[] for _ in self.ob_rrefs]
        self.running_reward = 0.5 * ep_reward + 0.5 * self.running_reward
        return ep_reward, self.running_reward, torch.stack(terms).sum().detach()


def run_worker(args: argparse.Namespace) -> None:
    if args.rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=args.rank, world_size=args.world_size)
        agent = Agent(args.world_size, batch=args.mode == "batch")
        initial = [p.detach().clone() for p in agent.policy.parameters()]
        rewards, running, losses = [], [], []
        for episode in range(EPISODES):
            reward, running_reward, loss = agent.run_episode(n_steps=NUM_STEPS)
            print(f"episode {episode}: reward {reward:.2f}, running {running_reward:.2f}")
            rewards.append(reward)
            running.append(running_reward)
            losses.append(loss)
        final = [p.detach().clone() for p in agent.policy.parameters()]
        save(args, {"rewards": rewards, "running_rewards": running,
                    "losses": torch.stack(losses), "initial": initial, "final": final})  # fmt: skip
    else:
        rpc.init_rpc(OBSERVER_NAME.format(args.rank), rank=args.rank, world_size=args.world_size)
    rpc.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="batch")


if __name__ == "__main__":
    main(1 + OBSERVERS, run_worker, add_arguments)
