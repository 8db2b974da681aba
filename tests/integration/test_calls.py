"""Calls between real worker processes over 127.0.0.1, sync and asyncio styles."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import asyncrpc
from asyncrpc.runtime.current import current_agent
from tests.integration import remote_fns as fns
from tests.integration.conftest import Group

pytestmark = pytest.mark.timeout(60)


def test_rpc_sync_python_function(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.add, args=(2, 3)) == 5
    assert asyncrpc.rpc_sync("w1", fns.add, args=(2,), kwargs={"b": 4}) == 6


def test_rpc_sync_accepts_rank_and_worker_info(group: Group) -> None:
    assert asyncrpc.rpc_sync(1, fns.whoami) == "w1"
    info = asyncrpc.get_worker_info("w3")
    assert info == asyncrpc.WorkerInfo("w3", 3)
    assert asyncrpc.rpc_sync(info, fns.whoami) == "w3"


def test_rpc_async_future_then_and_wait(group: Group) -> None:
    fut = asyncrpc.rpc_async("w2", fns.add, args=(1, 1))
    chained = fut.then(lambda f: f.value() * 100)
    assert chained.wait() == 200
    assert fut.done()
    assert fut.value() == 2


def test_builtin_torch_ops_run_remotely(group: Group) -> None:
    a, b = torch.ones(2, 3), torch.full((3, 2), 2.0)
    assert torch.equal(asyncrpc.rpc_sync("w1", torch.add, args=(a, a)), a + a)
    assert torch.equal(asyncrpc.rpc_sync("w3", torch.matmul, args=(a, b)), a @ b)


def test_torchscript_function_runs_remotely(group: Group) -> None:
    out = asyncrpc.rpc_sync("w1", fns.script_add, args=(torch.zeros(3), 4))
    assert torch.equal(out, torch.full((3,), 4.0))


def test_static_and_class_methods(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.Calculator.static_add, args=(4, 5)) == 9
    assert asyncrpc.rpc_sync("w2", fns.Calculator.class_name) == "Calculator"


def test_async_def_function_is_awaited_on_the_callee(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.async_add, args=(3, 4)) == 7
    assert asyncrpc.rpc_sync("w2", fns.async_whoami) == "w2"


def test_async_execution_variants(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.async_exec_add, args=("w3", 1, 2)) == 30
    assert asyncrpc.rpc_sync("w2", fns.async_exec_torch_future, args=(41,)) == 42
    assert asyncrpc.rpc_sync("w3", fns.async_exec_coroutine, args=(21,)) == 42
    assert asyncrpc.rpc_sync("w1", fns.Calculator.static_async_exec, args=(1,)) == 101
    assert asyncrpc.rpc_sync("w2", fns.Calculator.class_async_exec, args=(7,)) == "Calculator:7"


def test_inline_function_runs_on_the_callee_loop(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.thread_kind) == "pool"
    assert asyncrpc.rpc_sync("w1", fns.inline_thread_kind) == "loop"
    assert asyncrpc.rpc_sync("w2", fns.inline_thread_kind) == "loop"  # an init_rpc_async worker
    assert asyncrpc.remote("w3", fns.inline_thread_kind).to_here() == "loop"
    assert asyncrpc.rpc_sync("w3", fns.inline_async_exec_add, args=("w1", 2, 3)) == 5


def test_inline_function_errors_reach_the_caller(group: Group) -> None:
    with pytest.raises(fns.CustomError):
        asyncrpc.rpc_sync("w1", fns.inline_raises, args=("from the loop",))
    # A blocking call from the loop would deadlock it; it fails with a typed error instead.
    with pytest.raises(asyncrpc.BlockingCallError):
        asyncrpc.rpc_sync("w1", fns.inline_blocking_call, args=("w3",))
    assert asyncrpc.rpc_sync("w1", fns.add, args=(1, 2)) == 3  # the callee still serves


def test_nested_calls_including_back_to_the_caller(group: Group) -> None:
    assert asyncrpc.rpc_sync("w1", fns.nested_add, args=("w3", 10, 5)) == 15
    assert asyncrpc.rpc_sync("w2", fns.async_nested_add, args=("w1", 1, 2)) == 3
    assert asyncrpc.rpc_sync("w1", fns.call_back, args=("driver",)) == "driver"
    # w2 runs on init_rpc_async: its async function calls back into us from its own loop.
    assert asyncrpc.rpc_sync("w2", fns.async_nested_add, args=("driver", 2, 2)) == 4


def test_call_to_self(group: Group) -> None:
    assert asyncrpc.rpc_sync("driver", fns.add, args=(1, 2)) == 3
    assert asyncrpc.rpc_sync("driver", fns.async_add, args=(1, 2)) == 3


def test_sync_function_blocked_on_event_set_by_later_rpc(group: Group) -> None:
    waiting = asyncrpc.rpc_async("w1", fns.wait_for_event, args=("evt-1", 20.0))
    assert asyncrpc.rpc_sync("w1", fns.set_event, args=("evt-1",)) is True
    assert waiting.wait(30) is True


def test_many_concurrent_calls_from_threads(group: Group) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def worker(offset: int) -> None:
        futs = [asyncrpc.rpc_async("w3", fns.add, args=(offset, i)) for i in range(50)]
        values = asyncrpc.wait_all(futs)
        with lock:
            results.extend(values)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == sorted(k * 1000 + i for k in range(4) for i in range(50))


def test_collect_all_over_workers(group: Group) -> None:
    futs = [asyncrpc.rpc_async(f"w{r}", fns.whoami) for r in (1, 2, 3)]
    done = asyncrpc.collect_all(futs).wait()
    assert [f.value() for f in done] == ["w1", "w2", "w3"]


def test_worker_infos_and_timeout(group: Group) -> None:
    infos = asyncrpc.get_worker_infos()
    assert [i.name for i in infos] == ["driver", "w1", "w2", "w3"]
    assert [i.id for i in infos] == [0, 1, 2, 3]
    assert asyncrpc.get_worker_info() == asyncrpc.WorkerInfo("driver", 0)
    assert asyncrpc.get_rpc_timeout() == 30.0


@pytest.mark.asyncio
async def test_await_call_from_another_loop(group: Group) -> None:
    async with asyncio.timeout(30):
        assert await asyncrpc.call("w1", fns.add, 20, 22) == 42
        assert await asyncrpc.call("w2", fns.async_add, "a", "b") == "ab"
        values = await asyncio.gather(*(asyncrpc.call("w3", fns.add, i, i) for i in range(20)))
        assert values == [2 * i for i in range(20)]
        assert await asyncrpc.rpc_async("w1", fns.add, args=(1, 2)) == 3


@pytest.mark.asyncio
async def test_await_call_kwargs_reach_the_function(group: Group) -> None:
    # `timeout` is the user's keyword here, never stolen by asyncrpc.
    async with asyncio.timeout(30):
        assert await asyncrpc.call("w1", fns.echo, x={"timeout": 3}) == {"timeout": 3}


@pytest.mark.asyncio
async def test_asyncio_timeout_cancels_remote_async_work(group: Group) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await asyncrpc.call("w1", fns.async_sleep_noting_cancel, 20.0, "cancel-1")
    for _ in range(100):
        if await asyncrpc.call("w1", fns.was_cancelled, "cancel-1"):
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the remote coroutine was not cancelled")


def test_metrics_count_calls_and_bytes(group: Group) -> None:
    before = asyncrpc.get_metrics()
    asyncrpc.rpc_sync("w1", fns.echo, args=(torch.zeros(1024),))
    after = asyncrpc.get_metrics()
    assert after["calls_sent"] == before["calls_sent"] + 1
    assert after["bytes_out"] - before["bytes_out"] >= 4096
    assert after["bytes_in"] - before["bytes_in"] >= 4096
    assert after["open_connections"] >= 1
    assert after["thread_pool_size"] == 16
    assert "loop_lag_ms" in after
    remote = asyncrpc.rpc_sync("w1", fns.metrics)
    assert remote["calls_received"] >= 1
    info = asyncrpc.get_debug_info()
    assert info["name"] == "driver"
    assert info["world_size"] == 4


def test_same_host_peers_talk_over_unix_sockets(group: Group) -> None:
    assert asyncrpc.rpc_sync("w3", fns.add, args=(1, 2)) == 3
    assert asyncrpc.get_metrics()["open_unix_connections"] >= 1
    assert asyncrpc.rpc_sync("w3", fns.metrics)["open_unix_connections"] >= 1


def test_small_builtin_ops_run_on_the_callee_loop(group: Group) -> None:
    """torch.add on small tensors skips the callee's pool; on large ones it does not."""
    small, large = torch.arange(6.0).reshape(2, 3), torch.ones(1 << 16)

    async def on_loop() -> int:  # awaited calls take the loop's path, never a lane
        await asyncrpc.call("w1", torch.add, small, small)
        metrics = await asyncrpc.call("w1", fns.metrics)
        return int(metrics["calls_on_loop"])

    before = asyncrpc.rpc_sync("w1", fns.metrics)["calls_on_loop"]
    after = asyncio.run_coroutine_threadsafe(on_loop(), current_agent().loop.aio).result(30)
    assert after - before == 1  # the metrics call itself is a plain def function
    # From a thread: a small op on its lane runs on the lane's thread, a large one (its
    # frame too big for a lane) on the pool; neither on the loop.
    assert torch.equal(asyncrpc.rpc_sync("w1", torch.add, args=(small, small)), small * 2)
    pool_before = asyncrpc.rpc_sync("w1", fns.metrics)["handoffs_loop_to_pool"]
    assert asyncrpc.rpc_sync("w1", torch.add, args=(large, 1)).sum() == 2 * (1 << 16)
    assert asyncrpc.rpc_sync("w1", fns.metrics)["handoffs_loop_to_pool"] - pool_before == 1
    with pytest.raises(RuntimeError):  # the op's own error
        asyncrpc.rpc_sync("w1", torch.add, args=(torch.ones(3), torch.ones(4)))
