"""The cost database opened for writing: what ``onnx2soap profile`` stores its timings in.

The format (tables, version, the in-step method) is the reader's, ``sim/costdb.py``; this
module makes a new file in it, brings an older file up to it, and adds rows. Planning never
writes, so the simulator has no writer to import.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from onnx2soap.errors import UserError
from onnx2soap.sim.costdb import (
    FORMAT,
    IN_STEP_METHOD,
    IN_STEP_SCHEMA,
    SCHEMA,
    VERSION,
    CostDB,
    Fingerprint,
    InStep,
    Timing,
)


class CostWriter(CostDB):
    """A cost database open for reading and writing (made if the file is new)."""

    @classmethod
    def open(cls, path: Path | str) -> CostWriter:
        path = Path(path)
        try:
            db = cls(sqlite3.connect(path), path)
            db._prepare()
        except sqlite3.Error as e:
            raise UserError(f"{path}: not a cost database ({e})") from e
        return db

    def _prepare(self) -> None:
        """A new file gets the tables; an existing one is checked as the reader checks
        it, then gets the in-step table if it was written before calibration existed,
        and loses in-step times an older method took (the profile calibrates anew)."""
        if not any(self.conn.execute("SELECT name FROM sqlite_master")):
            self.conn.executescript(SCHEMA)
            self.conn.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [("format", FORMAT), ("version", str(VERSION)), ("in_step_method", IN_STEP_METHOD)],
            )
            self.conn.commit()
            return
        self.check()
        self.conn.executescript(IN_STEP_SCHEMA)
        if self.in_step_method != IN_STEP_METHOD:
            with self.conn:
                self.conn.execute("DELETE FROM in_step")
                self.conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('in_step_method', ?)", (IN_STEP_METHOD,)
                )
            self.in_step_method = IN_STEP_METHOD

    def add_fingerprint(self, fp: Fingerprint) -> int:
        """``fp``'s id, added if the file does not hold it yet."""
        found = self.find(fp)
        if found is not None:
            return found
        cur = self.conn.execute("INSERT INTO fingerprints (doc) VALUES (?)", (fp.to_json(),))
        self.conn.commit()
        return int(cur.lastrowid)

    def add(self, fp_id: int, timings: Iterable[Timing]) -> None:
        """Store a batch in one transaction: an interrupted profile loses at most it."""
        rows = [
            (fp_id, t.phase.value, t.key, t.op_type, t.flops, t.nbytes, t.seconds, t.ranks)
            for t in timings
        ]
        with self.conn:
            self.conn.executemany(
                "INSERT OR REPLACE INTO timings VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def add_in_step(self, fp_id: int, points: Iterable[InStep]) -> None:
        rows = [(fp_id, p.phase.value, p.key, p.seconds) for p in points]
        with self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO in_step VALUES (?, ?, ?, ?)", rows)
