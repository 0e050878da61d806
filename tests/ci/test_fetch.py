"""scripts/ci/fetch.py: one download per key across processes, and the marker."""

import multiprocessing as mp

import pytest

from scripts.ci import fetch


def hold_lock(lock_path, ready, release):
    with fetch.locked(lock_path):
        ready.set()
        release.wait(60)


def test_a_download_runs_once_and_leaves_the_ready_marker(tmp_path):
    calls = []
    target = tmp_path / "org" / "model"

    def download():
        calls.append(1)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    fetch.fetch_once(tmp_path, "org__model", target, download)
    fetch.fetch_once(tmp_path, "org__model", target, download)
    assert calls == [1]
    assert (target / fetch.READY_MARKER).is_file()


def test_a_half_finished_download_starts_over(tmp_path):
    target = tmp_path / "org" / "model"

    def broken():
        target.mkdir(parents=True)
        raise OSError("connection reset")

    with pytest.raises(OSError):
        fetch.fetch_once(tmp_path, "org__model", target, broken)
    assert not (target / fetch.READY_MARKER).exists()
    fetch.fetch_once(tmp_path, "org__model", target, lambda: None)
    assert (target / fetch.READY_MARKER).is_file()


def test_a_lock_held_by_another_process_times_out(tmp_path):
    lock = tmp_path / ".locks" / "k.flock"
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=hold_lock, args=(lock, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(TimeoutError, match="still locked"):
            with fetch.locked(lock, wait_s=0.2):
                pass
    finally:
        release.set()
        holder.join(60)
    with fetch.locked(lock, wait_s=5):
        pass  # free again once the holder let go
