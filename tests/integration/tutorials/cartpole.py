"""The environment of the reinforcement-learning programs at full length: our own cart
and pole, in place of gym's ``CartPole-v1`` (which the upstream programs import)."""

from __future__ import annotations

import math
from typing import Any

import torch


class CartPole:
    """A cart on a track with a pole hinged to it, in the classic equations of motion
    (Barto, Sutton and Anderson, 1983): push left or right each 20 ms; a reward of 1 a
    step until the pole leans past 12 degrees or the cart leaves the track, or 500 steps
    pass. Seeded, pure float math."""

    reward_threshold = 475.0
    GRAVITY, CART_MASS, POLE_MASS, HALF_POLE, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    MAX_STEPS, X_LIMIT, ANGLE_LIMIT = 500, 2.4, 12 * 2 * math.pi / 360

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.state = [0.0] * 4
        self.steps = 0

    def reset(self) -> torch.Tensor:
        self.state = ((torch.rand(4, generator=self.gen) - 0.5) * 0.1).tolist()
        self.steps = 0
        return torch.tensor(self.state)

    def step(self, action: int) -> tuple[torch.Tensor, float, bool, dict[str, Any]]:
        x, v, angle, spin = self.state
        force = self.FORCE if action == 1 else -self.FORCE
        total = self.CART_MASS + self.POLE_MASS
        cos, sin = math.cos(angle), math.sin(angle)
        # The pole's pull on the cart, then the two accelerations it couples.
        pull = (force + self.POLE_MASS * self.HALF_POLE * spin * spin * sin) / total
        spin_acc = (self.GRAVITY * sin - cos * pull) / (
            self.HALF_POLE * (4.0 / 3.0 - self.POLE_MASS * cos * cos / total)
        )
        acc = pull - self.POLE_MASS * self.HALF_POLE * spin_acc * cos / total
        # Explicit Euler, position before velocity.
        x, v = x + self.TAU * v, v + self.TAU * acc
        angle, spin = angle + self.TAU * spin, spin + self.TAU * spin_acc
        self.state = [x, v, angle, spin]
        self.steps += 1
        fallen = abs(x) > self.X_LIMIT or abs(angle) > self.ANGLE_LIMIT
        return torch.tensor(self.state), 1.0, fallen or self.steps >= self.MAX_STEPS, {}
