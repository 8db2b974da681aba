"""An IMPALA-style reinforcement-learning loop on one bidirectional stream per actor:
trajectories go from the actor to the learner, new weights from the learner to the actor.

Rank 0 is the learner; ranks 1..N are actors. The learner opens one stream per actor
(``asyncrpc.rpc_bidi(actor, act, ..., window=2)``): ``act`` is an async generator that runs
on the actor, takes the learner's weights as its request stream, plays a contextual bandit
with its copy of the policy and yields one unroll of observations, actions, rewards and
the behaviour policy's log-probabilities at a time. The window is the backpressure both
ways: an actor is never more than two unrolls ahead of the learner, which bounds how stale
its policy gets, and the learner's sender for an actor waits while that actor has two
versions of the weights unread, then sends the newest (a slow actor skips versions). The
learner corrects for the lag with truncated importance weights (IMPALA's V-trace without a
value function: rho clipped at 1).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from torch import nn

import asyncrpc
from asyncrpc.testing import free_port
from examples._launch import DEADLINE_S, workers, write_json

OBS, ACTIONS = 6, 3


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(OBS, ACTIONS)


class Bandit:
    """A contextual bandit: reward 1 when the action is the one a fixed hidden rule picks."""

    def __init__(self, seed: int) -> None:
        self.rule = torch.randn(OBS, ACTIONS, generator=torch.Generator().manual_seed(7))
        self.rng = torch.Generator().manual_seed(seed)

    def observe(self, n: int) -> torch.Tensor:
        return torch.randn(n, OBS, generator=self.rng)

    def reward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return ((obs @ self.rule).argmax(dim=1) == actions).float()


# -- the learner's side ---------------------------------------------------------------------


class Learner:
    """The policy being trained, and its version (bumped at every update)."""

    def __init__(self, lr: float) -> None:
        self.policy = make_policy()
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=lr)
        self.version = 0
        self.changed = asyncio.Condition()
        self.rewards: list[float] = []

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    async def learn(self, unroll: dict[str, torch.Tensor]) -> None:
        """One update from one unroll; then every actor's weight stream wakes up."""
        logp = torch.log_softmax(self.policy(unroll["obs"]), dim=1)
        taken = logp.gather(1, unroll["actions"].unsqueeze(1)).squeeze(1)
        rho = (taken.detach() - unroll["behaviour_logp"]).exp().clamp(max=1.0)
        advantage = unroll["rewards"] - unroll["rewards"].mean()
        entropy = -(logp.exp() * logp).sum(dim=1).mean()
        loss = -(rho * advantage * taken).mean() - 0.01 * entropy
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.rewards.append(float(unroll["rewards"].mean()))
        async with self.changed:
            self.version += 1
            self.changed.notify_all()


async def send_weights(learner: Learner, link: asyncrpc.Bidi[Any]) -> None:
    """On the learner, for one actor: each new version of the weights, the newest first.

    ``send`` waits while the actor has a window of versions unread; the version sent next
    is the newest then, so a slow actor skips versions instead of queueing them.
    """
    seen = 0  # the actor starts with version 0 (make_policy)
    while True:
        async with learner.changed:
            while learner.version <= seen:
                await learner.changed.wait()
        seen = learner.version
        await link.send((seen, learner.state()))


# -- the actors' side -----------------------------------------------------------------------


async def follow(weights: AsyncIterator[Any], policy: nn.Module, versions: list[int]) -> None:
    """Keep ``policy`` at the learner's newest weights (the requests of this actor's stream)."""
    async for version, state in weights:
        policy.load_state_dict(state)
        versions.append(version)


async def act(
    weights: AsyncIterator[Any], actor: int, unrolls: int, length: int
) -> AsyncIterator[dict[str, Any]]:
    """Runs on an actor: play ``unrolls`` unrolls of ``length`` steps, yielding each, while
    following the weights the learner sends on the same stream."""
    policy, env, versions = make_policy(), Bandit(seed=actor), [0]
    following = asyncio.create_task(follow(weights, policy, versions))
    try:
        for _ in range(unrolls):
            obs = env.observe(length)
            with torch.no_grad():
                logp = torch.log_softmax(policy(obs), dim=1)
            actions = torch.multinomial(logp.exp(), 1).squeeze(1)
            yield {
                "obs": obs,
                "actions": actions,
                "rewards": env.reward(obs, actions),
                "behaviour_logp": logp.gather(1, actions.unsqueeze(1)).squeeze(1),
                "version": versions[-1],
            }
            await asyncio.sleep(0)  # let the weights come in
    finally:  # runs when the learner is done with this actor, however that happens
        following.cancel()


# -- the programs ---------------------------------------------------------------------------


def _options(args: argparse.Namespace, *, serves_whole_run: bool) -> asyncrpc.RpcBackendOptions:
    # An actor is in its graceful shutdown from the moment it joins (it serves ``act``
    # until the learner is done): the whole run, bounded by the deadline, not a call's
    # timeout, or a run slower than ``--timeout`` (a loaded machine) loses its actors.
    return asyncrpc.RpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.timeout,
        shutdown_timeout=args.deadline if serves_whole_run else args.timeout,
    )


async def learn(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0: merge the actors' unrolls into one queue and learn from each."""
    world = args.actors + 1
    options = _options(args, serves_whole_run=False)
    async with asyncrpc.worker("learner", rank=0, world_size=world, rpc_backend_options=options):
        learner = Learner(args.lr)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=args.actors)
        lags: list[int] = []

        async def pump(actor: int) -> None:
            # One stream per actor, both ways: unrolls in, weights out.
            link = asyncrpc.rpc_bidi(
                f"actor{actor}", act, args=(actor, args.unrolls, args.length), window=2
            )
            async with link:
                sending = asyncio.create_task(send_weights(learner, link))
                try:
                    async for unroll in link:
                        await queue.put(unroll)
                finally:
                    sending.cancel()

        # In a task group: an actor's stream that fails (the actor died) ends the learner
        # at once with its error, instead of leaving it waiting for unrolls for good.
        async with asyncio.TaskGroup() as pumps:
            for actor in range(1, world):
                pumps.create_task(pump(actor))
            for step in range(1, args.actors * args.unrolls + 1):
                unroll = await queue.get()
                lags.append(learner.version - unroll["version"])
                await learner.learn(unroll)
                if step % 20 == 0:
                    recent = learner.rewards[-20:]
                    print(f"update {step:4d}  reward {sum(recent) / len(recent):.3f}  "
                          f"policy lag {max(lags[-20:])}", flush=True)  # fmt: skip
    return {"rewards": learner.rewards, "max_lag": max(lags), "updates": learner.version}


async def serve(args: argparse.Namespace) -> None:
    """Ranks 1..N: an actor joins and serves (``act`` is streamed from it) until shutdown."""
    options = _options(args, serves_whole_run=True)
    async with asyncrpc.worker(f"actor{args.rank}", rank=args.rank, world_size=args.world_size,
                               rpc_backend_options=options):  # fmt: skip
        pass


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.actor_learner")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--unrolls", type=int, default=150, help="per actor")
    parser.add_argument("--length", type=int, default=32, help="steps per unroll")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=60.0, help="per call, and to join")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help="seconds for the whole run; past it the run is stopped")  # fmt: skip
    parser.add_argument("--json", help="write the rewards here")
    parser.add_argument("--role", choices=("main", "worker"), default="main")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=0)
    parser.add_argument("--init-method", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the example; exit 0 when the reward rose."""
    args = parse(argv)
    if args.role == "worker":
        asyncio.run(serve(args))
        return 0
    args.init_method = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    print(f"learner + {args.actors} actors, {args.unrolls} unrolls each", flush=True)
    extra = ["--timeout", str(args.timeout), "--deadline", str(args.deadline)]
    ranks = range(1, args.actors + 1)
    with workers(__name__, ranks, args.actors + 1, args.init_method, extra, args.deadline):
        result = asyncio.run(learn(args))
    rewards = result["rewards"]
    k = max(1, len(rewards) // 5)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    rose = last > first
    print(f"reward {first:.3f} -> {last:.3f} ({'rose' if rose else 'DID NOT RISE'}), "
          f"policy lag at most {result['max_lag']} updates, "
          f"in {time.monotonic() - start:.1f}s", flush=True)  # fmt: skip
    write_json(args.json, {**result, "first": first, "last": last, "rose": rose})
    return 0 if rose else 1


if __name__ == "__main__":
    sys.exit(main())
