"""Which request's block table each row of the decode step's static block-table buffer holds,
and so which rows must be copied to the device before a step. Pure Python.

The buffer is [num_rows, width] (width = the most blocks any request can have); the device
copy of row r must equal `block_table + [null] * (width - len(block_table))` of the request
in row r, or all null for a padded row. A request's block table only grows while it runs
(decode reserves the whole table at admission; single-process generation appends a block at
each boundary), so a row needs copying only when its request changes or its table grew:

    step 1: rows [A=[3, 9], B=[4]]        -> rows 0, 1 change (new requests)
    step 2: rows [A=[3, 9], B=[4, 7]]     -> row 1 (B grew)
    step 3: rows [A=[3, 9], C=[5], pad]   -> rows 1, 2 (C replaced B; row 2 becomes null)
    step 4: rows [A=[3, 9], C=[5], pad]   -> nothing

A request is recognised by its block table list object (`is`), which this class keeps a
reference to, so the identity cannot be reused by another list while the row holds it.
"""

from __future__ import annotations

from collections.abc import Sequence


class BlockTableRows:
    """The block table each row holds, as last copied to the device."""

    def __init__(self, num_rows: int, width: int) -> None:
        if num_rows <= 0 or width <= 0:
            raise ValueError(f"num_rows ({num_rows}) and width ({width}) must be > 0")
        self.num_rows = num_rows
        self.width = width
        # Per row: (the request's block table list, its length when copied); None = all null.
        self._held: list[tuple[list[int], int] | None] = [None] * num_rows

    def update(self, tables: Sequence[list[int] | None]) -> list[int]:
        """Rows 0 .. len(tables)-1 now hold `tables` (None: a padded row, all null).

        Returns the rows whose contents change, ascending: the caller copies exactly those.
        Rows from len(tables) on are not part of the step and keep what they hold.
        """
        if len(tables) > self.num_rows:
            raise ValueError(f"{len(tables)} rows do not fit the {self.num_rows}-row buffer")
        changed = []
        for row, table in enumerate(tables):
            held = self._held[row]
            if table is None:
                if held is not None:
                    self._held[row] = None
                    changed.append(row)
                continue
            if len(table) > self.width:
                raise ValueError(
                    f"a block table of {len(table)} blocks does not fit the width {self.width}"
                )
            if held is None or held[0] is not table or held[1] != len(table):
                self._held[row] = (table, len(table))
                changed.append(row)
        return changed

    def held(self, row: int) -> list[int] | None:
        """The block table row `row` holds on the device (a copy), or None for all null."""
        held = self._held[row]
        return None if held is None else held[0][: held[1]]
