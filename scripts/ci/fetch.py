"""Download a catalog entry's checkpoints and GSM8K into a shared cache, once.

  python -m scripts.ci.fetch --entry "Kimi-K3 DSpark PP2" --root /models

Runners share one model folder, so each download holds a lock
(`ROOT/.locks/<key>.flock`, waited on for up to 30 minutes) and ends with a ready
marker (`.atom_download_complete`): a later job, or one that waited on the lock,
finds the marker and skips the download; a download that died half-way left no
marker and starts over. This is ROCm/ATOM's download_model_with_lock.sh scheme.
Checkpoints go to ROOT/<hf id>; the dataset into the Hugging Face cache (HF_HOME),
which the workflow keeps under ROOT too, so the evaluation can run with
HF_HUB_OFFLINE=1. A token in HF_TOKEN is used when set.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from scripts.ci.catalog import DEFAULT_CATALOG, CatalogError, find_entry, load_catalog

READY_MARKER = ".atom_download_complete"
LOCK_WAIT_S = 1800.0
LOCK_POLL_S = 5.0
GSM8K_DATASET = ("openai/gsm8k", "main")


@contextlib.contextmanager
def locked(lock_path: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`, waiting up to `wait_s` for it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{lock_path} still locked after {wait_s:.0f} s"
                    ) from None
                time.sleep(min(LOCK_POLL_S, max(deadline - time.monotonic(), 0.05)))
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_once(root: Path, key: str, ready_dir: Path, download: Callable[[], None]):
    """Run `download` under the lock for `key` unless `ready_dir` has its marker."""
    with locked(root / ".locks" / f"{key}.flock"):
        marker = ready_dir / READY_MARKER
        if marker.is_file():
            print(f"fetch: {key} is cached in {ready_dir}")
            return
        print(f"fetch: downloading {key} into {ready_dir}", flush=True)
        download()
        ready_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()


def fetch_checkpoint(root: Path, repo_id: str) -> None:
    from huggingface_hub import snapshot_download

    destination = root / repo_id
    fetch_once(
        root,
        repo_id.replace("/", "__"),
        destination,
        lambda: snapshot_download(
            repo_id=repo_id,
            local_dir=destination,
            token=os.environ.get("HF_TOKEN") or None,
        ),
    )


def fetch_dataset(root: Path, repo_id: str, config: str) -> None:
    import datasets

    def download() -> None:
        datasets.load_dataset(repo_id, config)

    key = f"dataset__{repo_id.replace('/', '__')}__{config}"
    fetch_once(root, key, root / ".datasets" / key, download)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", required=True)
    parser.add_argument("--catalog", default=str(DEFAULT_CATALOG))
    parser.add_argument("--root", default="/models", help="the shared model folder")
    args = parser.parse_args(argv)
    try:
        entry = find_entry(load_catalog(args.catalog), args.entry)
        root = Path(args.root)
        for repo_id in entry.checkpoints():
            fetch_checkpoint(root, repo_id)
        fetch_dataset(root, *GSM8K_DATASET)
    except (CatalogError, TimeoutError) as error:
        print(f"fetch: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
