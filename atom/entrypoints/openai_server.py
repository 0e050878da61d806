"""`python -m atom.entrypoints.openai_server`: the canonical server launch."""

import logging
import resource
from collections.abc import Sequence

from atom.entrypoints.openai import api_server


def raise_open_file_limit() -> None:
    """Many concurrent clients need many sockets; lift the soft limit if allowed."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = 65536 if hard == resource.RLIM_INFINITY else hard
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
    except (ValueError, OSError) as error:
        logging.getLogger(__name__).warning("could not raise the file limit: %s", error)


def main(argv: Sequence[str] | None = None) -> None:
    raise_open_file_limit()
    api_server.main(argv)


if __name__ == "__main__":
    main()
