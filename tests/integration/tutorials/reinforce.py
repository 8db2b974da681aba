"""The reinforcement-learning half of "Getting Started with Distributed RPC Framework".

Rank 0 is the agent: it makes one ``Observer`` on each other rank with ``rpc.remote``
and, each episode, starts every observer's ``run_episode`` with ``rpc_async`` through its
RRef. Observers step their environment and call back to the agent (through the agent's
``RRef(self)``) to choose actions and report rewards; the agent then trains its policy
with REINFORCE. Changes from the tutorial: a tiny deterministic environment stands in
for gym's CartPole, the policy has no dropout, and each observer's actions are drawn from
a generator of its own, so the result does not depend on how the observers' calls
interleave on the agent.

With ``--full``, the lengths of pytorch/examples ``distributed/rpc/rl``: one observer,
episodes of up to 5000 steps, the upstream's policy (128 wide, with dropout), on
``CartPole`` (ours, with CartPole-v1's 500-step limit and reward threshold of 475), until
the running reward passes the threshold. The upstream program has no episode limit; ours
stops after ``MAX_EPISODES`` and says in its results whether it got there.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from tests.integration.tutorials.cartpole import CartPole
from tests.integration.tutorials.common import full, impl, main, save, seeded

if impl() == "torch":
    import torch.distributed.rpc as rpc  # noqa: PLR0402 (the tutorials spell it so)
    from torch.distributed.rpc import RRef, rpc_async, rpc_sync
else:
    import asyncrpc as rpc
    from asyncrpc import RRef, rpc_async, rpc_sync

AGENT_NAME, OBSERVER_NAME = "agent", "observer{}"
GAMMA, LOG_INTERVAL = 0.99, 10
if full():
    # The upstream's world of 2 and its 5000 steps an episode, split among the observers.
    OBSERVERS, MAX_EPISODES, N_STEPS, HIDDEN, DROPOUT = 1, 3000, 5000, 128, 0.6
else:
    OBSERVERS, MAX_EPISODES, N_STEPS, HIDDEN, DROPOUT = 2, 4, 24, 16, 0.0


class DummyEnv:
    """CartPole's shape in a few lines: four floats of state, two actions, a reward of 1
    a step until the pole falls or the cart leaves the track. Seeded, pure float math."""

    reward_threshold = 11.0

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.state = [0.0] * 4

    def reset(self) -> torch.Tensor:
        self.state = ((torch.rand(4, generator=self.gen) - 0.5) * 0.2).tolist()
        return torch.tensor(self.state)

    def step(self, action: int) -> tuple[torch.Tensor, float, bool, dict[str, Any]]:
        x, v, angle, spin = self.state
        force = 1.0 if action == 1 else -1.0
        spin += 0.1 * (3.0 * angle - force)  # the pole falls; pushing the cart rights it
        angle += 0.1 * spin
        v += 0.1 * force
        x += 0.1 * v
        self.state = [x, v, angle, spin]
        done = abs(angle) > 0.3 or abs(x) > 1.0
        return torch.tensor(self.state), 1.0, done, {}


Env = CartPole if full() else DummyEnv


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, HIDDEN)
        # Dropout draws its masks from the global generator, in the order the observers'
        # calls come: reproducible with one observer only. Without it, the policy of the
        # full run settles on one action within 20 episodes and never learns.
        self.dropout = nn.Dropout(DROPOUT) if DROPOUT else nn.Identity()
        self.affine2 = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return rpc_sync(rref.owner(), _call_method, args=(method, rref, *args), kwargs=kwargs)


class Observer:
    def __init__(self) -> None:
        self.id = rpc.get_worker_info().id
        self.env = Env(seed=self.id)

    def run_episode(self, agent_rref: Any, n_steps: int) -> None:
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done, _ = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self, world_size: int) -> None:
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards: dict[int, list[float]] = {}
        self.saved_log_probs: dict[int, list[torch.Tensor]] = {}
        self.generators: dict[int, torch.Generator] = {}
        with seeded(0):
            self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = torch.finfo(torch.float32).eps
        self.running_reward = 0.0
        self.reward_threshold = Env.reward_threshold
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(rpc.remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []
            self.generators[ob_info.id] = torch.Generator().manual_seed(1000 + ob_info.id)

    def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        probs = self.policy(state.float().unsqueeze(0))
        m = Categorical(probs)
        # m.sample() would draw from the global generator, in the order calls arrive.
        action = torch.multinomial(probs.detach(), 1, generator=self.generators[ob_id])[:, 0]
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return int(action.item())

    def report_reward(self, ob_id: int, reward: float) -> None:
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps: int = 0) -> None:
        futs = [
            rpc_async(ob_rref.owner(), _call_method,
                      args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
            for ob_rref in self.ob_rrefs
        ]  # fmt: skip
        for fut in futs:
            fut.wait()

    def finish_episode(self) -> tuple[float, torch.Tensor]:
        R, probs, rewards = 0.0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.extend(self.rewards[ob_id])
        min_reward = min(sum(self.rewards[ob_id]) for ob_id in self.rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        returns: list[float] = []
        for r in rewards[::-1]:
            R = r + GAMMA * R
            returns.insert(0, R)
        returns_t = torch.tensor(returns)
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + self.eps)
        terms = [-log_prob * R for log_prob, R in zip(probs, returns_t, strict=True)]
        self.optimizer.zero_grad()
        backward_in_order(terms)
        self.optimizer.step()
        return min_reward, torch.cat(terms).sum().detach()


def backward_in_order(terms: list[torch.Tensor]) -> None:
    """Backward through each step's term in turn (the tutorial: one backward of their sum).

    Each term's graph was built on whichever pool thread served its call, and one backward
    over all of them would add their gradients in the order of the nodes' sequence
    numbers, which autograd counts per thread: an order torch's and asyncrpc's pools (or
    two torch runs) need not share. One float32 rounding apart, a policy draws another
    action some hundred episodes later, and the runs part. Term by term, the gradients
    add in the steps' order.
    """
    for term in terms:
        term.sum().backward()


def run_worker(args: argparse.Namespace) -> None:
    if args.rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=args.rank, world_size=args.world_size)
        agent = Agent(args.world_size)
        initial = [p.detach().clone() for p in agent.policy.parameters()]
        min_rewards, running, losses = [], [], []
        for episode in range(1, MAX_EPISODES + 1):
            agent.run_episode(n_steps=N_STEPS // OBSERVERS)
            last_reward, loss = agent.finish_episode()
            min_rewards.append(last_reward)
            running.append(agent.running_reward)
            losses.append(loss)
            if episode % LOG_INTERVAL == 0:
                print(f"episode {episode}: last reward {last_reward:.2f}, "
                      f"running reward {agent.running_reward:.2f}", flush=True)  # fmt: skip
            if agent.running_reward > agent.reward_threshold:
                print(f"solved at episode {episode}", flush=True)
                break
        final = [p.detach().clone() for p in agent.policy.parameters()]
        save(args, {"min_rewards": min_rewards, "running_rewards": torch.tensor(running),
                    "losses": torch.stack(losses), "initial": initial, "final": final,
                    "solved": agent.running_reward > agent.reward_threshold})  # fmt: skip
    else:
        rpc.init_rpc(OBSERVER_NAME.format(args.rank), rank=args.rank, world_size=args.world_size)
        # observers passively wait for the agent's instructions
    rpc.shutdown()


if __name__ == "__main__":
    main(1 + OBSERVERS, run_worker)
