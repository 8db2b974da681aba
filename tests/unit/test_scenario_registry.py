"""The scenario registry and its one parser (tests/scenarios/registry.py): names are
unique, every scenario takes the common flags, and its own defaults stay its own."""

from __future__ import annotations

import pytest

from tests.scenarios import __main__ as entry
from tests.scenarios.registry import SCENARIOS, parse, scenario

COMMON = ["--init-method", "tcp://127.0.0.1:1", "--name", "n", "--rank", "2", "--world-size", "3"]


def test_scenario_registry_holds_every_topic() -> None:
    assert entry.main is not None  # importing the entry point registered every module
    assert {"kill_peer", "heal", "owner_killed", "dynamic_member", "ddp_hybrid"} <= set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_takes_the_common_flags(name: str) -> None:
    required = {"faults": ["--proxies", "1:2"], "tls": ["--tls-dir", "d"],
                "auth_attacks": ["--marker", "m"], "ddp_hybrid": ["--pg-port", "1", "--out", "o",
                "--steps", "1,1"], "ddp_concurrent": ["--pg-port", "1", "--out", "o"],
                "ps_job": ["--role", "ps"], "ddp_teardown": ["--pg-port", "1"]}  # fmt: skip
    args = parse([name, *COMMON, *required.get(name, [])])
    assert (args.scenario, args.init_method, args.name) == (name, "tcp://127.0.0.1:1", "n")
    assert (args.rank, args.world_size) == (2, 3)


def test_scenario_defaults_stay_with_their_scenario() -> None:
    heal, member = parse(["heal"]), parse(["member"])
    assert (heal.world_size, heal.rpc_timeout, heal.drops) == (2, 20.0, 100)
    assert (member.world_size, member.rpc_timeout) == (None, 10.0)
    assert not hasattr(member, "drops")  # another scenario's flag


def test_scenario_rejects_another_scenarios_flag() -> None:
    with pytest.raises(SystemExit):
        parse(["member", "--drops", "3"])


def test_scenario_name_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        scenario("heal")(lambda args: 0)
