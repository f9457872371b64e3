"""How every service process writes its log: stderr, block-buffered, flushed at least every
FLUSH_INTERVAL_S and at once for a warning or worse.

Why not Python's default (a write and a flush per line): the scheduler writes one structured line
per finished request. Under `bench cluster` (8 mock workers, 64 streams) that line cost about 0.4 ms
of the scheduler's 2.2 ms of CPU per request; writing in blocks took back about 0.3 ms of it.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time

FLUSH_INTERVAL_S = 0.5
BUFFER_BYTES = 64 * 1024


class BufferedStderrHandler(logging.StreamHandler):
    """A StreamHandler on a block-buffered copy of file descriptor 2 that does not flush per record."""

    def __init__(self) -> None:
        stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False), BUFFER_BYTES),
                                  encoding="utf-8", errors="backslashreplace", write_through=False)
        super().__init__(stream)
        self._flusher = threading.Thread(target=self._flush_periodically, name="log-flush", daemon=True)
        self._flusher.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            if record.levelno >= logging.WARNING:
                self.flush()
        except Exception:
            self.handleError(record)

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()


def setup_logging(component: str) -> None:
    """Root logger at METROSERVE_LOG_LEVEL (default INFO), lines prefixed with the component and pid.
    Like logging.basicConfig, it does nothing when the root logger has a handler already."""
    if logging.getLogger().handlers:
        return
    handler = BufferedStderrHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("METROSERVE_LOG_LEVEL", "INFO"), handlers=[handler])
