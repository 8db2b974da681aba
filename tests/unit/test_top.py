"""``asyncrpc.top`` from canned scrapes: the text format, rates, p50/p99, HUNG and lost."""

from __future__ import annotations

import pytest

from asyncrpc.top.board import DOWN, HUNG, UP, Attempt, Board
from asyncrpc.top.discover import store_address
from asyncrpc.top.exposition import ExpositionError, parse
from asyncrpc.top.figures import extract, quantile
from asyncrpc.top.render import frame, text
from asyncrpc.top.scrape import normalize_url

pytestmark = pytest.mark.timeout(10)


def scrape_text(worker: str, *, sent: float, fast: float, slow: float, lost: str = "") -> str:
    """A worker's /metrics as asyncrpc.metrics serves it: ``fast`` calls ended within
    1 ms, ``slow`` more between 10 and 100 ms."""
    w = f'worker="{worker}"'
    total = fast + slow
    lines = [
        "# HELP asyncrpc_worker_info This worker's name, rank and group size",
        "# TYPE asyncrpc_worker_info gauge",
        f'asyncrpc_worker_info{{rank="{worker[-1]}",{w},world_size="3"}} 1.0',
        f"asyncrpc_calls_sent_total{{{w}}} {sent}",
        f"asyncrpc_calls_received_total{{{w}}} {sent / 2}",
        f"asyncrpc_bytes_in_total{{{w}}} {sent * 100}",
        f"asyncrpc_bytes_out_total{{{w}}} {sent * 200}",
        f"asyncrpc_pending_calls{{{w}}} 3.0",
        f"asyncrpc_running_requests{{{w}}} 1.0",
        f"asyncrpc_thread_pool_size{{{w}}} 16.0",
        f"asyncrpc_thread_pool_busy{{{w}}} 4.0",
        f"asyncrpc_loop_lag_ms{{{w}}} 2.5",
        f"asyncrpc_streams_consuming{{{w}}} 1.0",
        f"asyncrpc_stream_items_received_total{{{w}}} {sent}",
        f"asyncrpc_peers_lost{{{w}}} {1.0 if lost else 0.0}",
        f'asyncrpc_pending_calls_by_peer{{peer="w9",{w}}} 3.0',
    ]
    if lost:
        lines.append(f'asyncrpc_peer_lost{{peer="{lost}",{w}}} 1.0')
    # Two (kind, peer) series: top sums them. Half the calls in each.
    for kind in ("sync", "async"):
        for le, n in (("0.001", fast), ("0.01", fast), ("0.1", total), ("+Inf", total)):
            lines.append(
                f'asyncrpc_call_latency_seconds_bucket{{kind="{kind}",le="{le}",peer="w9",{w}}} '
                f"{n / 2}"
            )
        lines.append(
            f'asyncrpc_call_latency_seconds_count{{kind="{kind}",peer="w9",{w}}} {total / 2}'
        )
    return "\n".join(lines) + "\n"


def test_Exposition_reads_labels_escapes_and_special_values() -> None:
    samples = parse('# HELP x y\n\nm{a="1",b="q\\"uo\\\\te\\nx"} +Inf 1700000000\nn 2.5\no{} NaN\n')
    assert [(s.name, s.labels) for s in samples] == [
        ("m", {"a": "1", "b": 'q"uo\\te\nx'}), ("n", {}), ("o", {}),
    ]  # fmt: skip
    assert samples[0].value == float("inf")
    assert samples[1].value == 2.5
    with pytest.raises(ExpositionError):
        parse('m{a="1} 2\n')
    with pytest.raises(ExpositionError):
        parse("m two\n")


def test_Figures_extract_a_workers_scrape() -> None:
    figures = extract(parse(scrape_text("w1", sent=100, fast=80, slow=20, lost="w2")))
    assert (figures.worker, figures.rank, figures.world_size) == ("w1", "1", "3")
    assert figures.get("calls_sent_total") == 100
    assert figures.get("pending_calls") == 3
    assert "pending_calls_by_peer" not in figures.values  # labelled by peer: not a figure
    assert figures.lost == ("w2",)
    assert figures.latency == {0.001: 80, 0.01: 80, 0.1: 100, float("inf"): 100}


def test_Figures_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    buckets = {0.001: 80.0, 0.01: 80.0, 0.1: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets, {}) == pytest.approx(0.001 * 50 / 80)
    # The 99th is the 19th of the 20 in (0.01, 0.1]: 0.01 + 0.09 * 19/20.
    assert quantile(0.99, buckets, {}) == pytest.approx(0.01 + 0.09 * 19 / 20)
    # Over a window: only the calls that ended since (here all 20 slow ones).
    since = {0.001: 80.0, 0.01: 80.0, 0.1: 80.0, float("inf"): 80.0}
    assert quantile(0.5, buckets, since) == pytest.approx(0.01 + 0.09 * 10 / 20)
    assert quantile(0.5, buckets, buckets) is None  # no call ended
    assert quantile(0.99, {1.0: 0.0, float("inf"): 5.0}, {}) == 1.0  # +Inf: the last bound


def attempt(at: float, body: str) -> Attempt:
    return Attempt(at, figures=extract(parse(body)))


def board_of_three() -> Board:
    """w0 and w1 scraped twice, 2 s apart; w2 once, then it stopped answering."""
    board = Board(["http://h:1/metrics", "http://h:2/metrics", "http://h:3/metrics"], window=5.0)
    board.record([
        attempt(10.0, scrape_text("w0", sent=100, fast=100, slow=0)),
        attempt(10.0, scrape_text("w1", sent=50, fast=50, slow=0)),
        attempt(10.0, scrape_text("w2", sent=7, fast=7, slow=0)),
    ])  # fmt: skip
    board.record([
        attempt(12.0, scrape_text("w0", sent=500, fast=400, slow=0, lost="w2")),
        attempt(12.0, scrape_text("w1", sent=90, fast=50, slow=40, lost="w2")),
        Attempt(13.0, state=HUNG, reason="no answer in 1s"),
    ])  # fmt: skip
    return board


def test_Board_rates_and_latency_over_the_window() -> None:
    w0, w1, _ = board_of_three().rows(now=13.0)
    assert w0.state == UP
    assert w0.calls_out == pytest.approx(200.0)  # (500 - 100) / 2 s
    assert w0.calls_in == pytest.approx(100.0)
    assert (w0.bytes_in, w0.bytes_out) == (pytest.approx(20_000), pytest.approx(40_000))
    assert (w0.pending, w0.running, w0.pool_busy, w0.pool_size) == (3, 1, 4, 16)
    assert w0.p99 is not None
    assert w0.p99 < 0.001
    # w1's 40 calls of the window were all slow: its p50 is in (10 ms, 100 ms].
    assert w1.p50 is not None
    assert 0.01 < w1.p50 <= 0.1


def test_Board_marks_a_silent_worker_hung_and_names_who_lost_it() -> None:
    w0, _w1, w2 = board_of_three().rows(now=13.0)
    assert (w2.worker, w2.state) == ("w2", HUNG)
    assert w2.calls_out is None
    assert w2.p50 is None
    assert w2.pending is None  # nor its last gauges
    assert w2.lost_by == ("w0", "w1")
    assert "last answer 3.0s ago" in w2.reason
    assert w0.lost == ("w2",)
    assert w0.lost_by == ()


def test_Board_shows_a_lost_worker_that_no_endpoint_serves() -> None:
    board = Board(["http://h:1/metrics", "http://h:2/metrics"])
    board.record([
        attempt(1.0, scrape_text("w0", sent=1, fast=1, slow=0, lost="w7")),
        Attempt(1.0, state=DOWN, reason="Connection refused"),
    ])  # fmt: skip
    rows = board.rows(now=1.0)
    assert [(r.worker, r.state) for r in rows] == [("w0", UP), ("?", DOWN), ("w7", "LOST")]
    assert rows[2].lost_by == ("w0",)


def test_Render_frame_shows_each_worker_and_marks_the_hung_one() -> None:
    lines = frame(board_of_three().rows(now=13.0), interval=1.0, wall=0.0)
    shown = text(lines)
    assert "2/3 up, world size 3" in lines[0].text
    assert lines[1].text.split()[:4] == ["WORKER", "RANK", "STATE", "OUT/s"]
    w0 = next(line for line in lines if line.text.startswith("w0 "))
    assert w0.text.split()[:5] == ["w0", "0", "up", "200", "100"]
    assert w0.text.split()[-1] == "w2"
    assert not w0.alert
    w2 = next(line for line in lines if line.text.startswith("w2 "))
    assert w2.alert
    assert w2.text.split()[2] == "HUNG"
    assert "^ w2: no answer in 1s; last answer 3.0s ago; lost by w0 w1" in shown
    # The streams: one open on w0 and w1, moving at their items' rate.
    assert "STREAMS" in shown
    assert any(line.text.strip().startswith("w0") and "200 items/s" in line.text for line in lines)


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("9464", "http://127.0.0.1:9464/metrics"),
        ("node1:9464", "http://node1:9464/metrics"),
        ("http://node1:9464/custom", "http://node1:9464/custom"),
    ],
)
def test_Scrape_normalize_url(given: str, url: str) -> None:
    assert normalize_url(given) == url


def test_Board_a_stream_with_no_item_for_longer_than_the_window_shows_how_long() -> None:
    board = Board(["http://h:1/metrics"], window=5.0)
    for at, sent in ((0.0, 10), (4.0, 30), (8.0, 30), (12.0, 30), (16.0, 30)):
        board.record([attempt(at, scrape_text("w0", sent=sent, fast=sent, slow=0))])
    (w0,) = board.rows(now=16.0)
    assert w0.stream is not None
    assert w0.stream.items_per_s == 0
    assert w0.stream.still_for == 12.0  # since 4.0, past the 5 s window
    line = next(line for line in frame([w0], interval=1.0) if "open" in line.text)
    assert "no item for 12s" in line.text
    assert line.alert


def test_Render_a_stream_line_shows_its_movement_scrape_by_scrape() -> None:
    board = Board(["http://h:1/metrics"], window=5.0)
    # 10 items/s, then 40, then nothing for three scrapes.
    for at, sent in ((0.0, 0), (1.0, 10), (2.0, 20), (3.0, 60), (4.0, 60), (5.0, 60), (6.0, 60)):
        board.record([attempt(at, scrape_text("w0", sent=sent, fast=sent, slow=0))])
    (w0,) = board.rows(now=6.0)
    assert w0.stream is not None
    assert w0.stream.history == (10.0, 10.0, 40.0, 0.0, 0.0, 0.0)
    line = next(line for line in frame([w0], interval=1.0) if "open" in line.text)
    # Oldest left, in quarters of the peak; a dot where no item moved.
    assert "[      ::#...]" in line.text
    assert "60 items so far" in line.text
    # The rate is the window's (5 s: 50 items); "no item for" waits for a whole window.
    assert "10 items/s" in line.text


def test_Board_watch_keeps_the_history_of_endpoints_it_watched_already() -> None:
    board = Board(["http://h:1/metrics"])
    board.record([attempt(1.0, scrape_text("w0", sent=10, fast=10, slow=0))])
    board.watch(["http://h:0/metrics", "http://h:1/metrics"])
    assert board.urls == ["http://h:0/metrics", "http://h:1/metrics"]
    assert board.endpoints[0].last is None
    assert board.endpoints[1].name == "w0"


def test_Discover_store_address_of_tcp_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_address("tcp://node1:29500") == ("node1", 29500)
    assert store_address("tcp://10.0.0.1:29500?rank=0&world_size=4") == ("10.0.0.1", 29500)
    monkeypatch.setenv("MASTER_ADDR", "node2")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert store_address("env://") == ("node2", 1234)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        store_address("env://")
    for bad in ("file:///tmp/x", "tcp://node1"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            store_address(bad)


def test_Render_frame_marks_a_note_under_the_header() -> None:
    lines = frame([], interval=1.0, wall=0.0, notes=["rendezvous store: gone"])
    assert "0/0 up" in lines[0].text
    assert lines[1].text == "  ! rendezvous store: gone"
    assert lines[1].alert
    assert lines[2].text.split()[0] == "WORKER"
