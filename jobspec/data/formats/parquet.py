"""`data.format: parquet` (.parquet, .pq): a columnar table (pyarrow), its row count in the
metadata. Its bytes are compressed: validate reads its first `checked_rows` rows rather than a
number of bytes."""
from __future__ import annotations

from pathlib import Path

from jobspec.data.formats.base import DataFormat, Rows
from jobspec.data.records.base import BadRecord
from jobspec.errors import first_line


class ParquetFormat(DataFormat):
    name = "parquet"
    suffixes = (".parquet", ".pq")
    checked_rows = 200_000
    datasets_builder = "parquet"

    def _file(self, path: Path, split: str):
        import pyarrow.parquet as pq  # only for parquet data
        try:
            return pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError with a reason
            raise BadRecord(("data", split),
                            f"{path} is not a readable parquet file ({first_line(err)})",
                            "check the file and data.format") from None

    def columns(self, path: Path, split: str) -> list[str] | None:
        return list(self._file(path, split).schema_arrow.names)

    def rows(self, path: Path, split: str, *, columns: list[str] | None, label: str | None,
             max_rows: int | None, max_bytes: int | None) -> Rows:
        number = 0
        for batch in self._file(path,
                                split).iter_batches(batch_size=min(max_rows or 10_000, 10_000),
                                                          columns=columns):
            try:
                rows = batch.to_pylist()
            except UnicodeDecodeError:  # find the row: one at a time
                rows = None
            for offset in range(batch.num_rows):
                number += 1
                if rows is not None:
                    yield f"{path}: row {number}", rows[offset]
                else:
                    yield f"{path}: row {number}", _row(batch, offset, path, number, split)
                if max_rows is not None and number >= max_rows:
                    return

    def first_rows(self, path: Path, limit: int) -> list[dict]:
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
        return batch.to_pylist() if batch is not None else []

    def count_rows(self, path: Path) -> int:
        import pyarrow.parquet as pq  # the metadata holds the row count

        return int(pq.ParquetFile(path).metadata.num_rows)


def _row(batch, offset: int, path: Path, number: int, split: str) -> dict | BadRecord:
    try:
        return batch.slice(offset, 1).to_pylist()[0]
    except UnicodeDecodeError as err:
        return BadRecord(("data", split),
                         f"{path}: row {number} holds a string that is not valid UTF-8 ({err})",
                         "rewrite the file with UTF-8 strings")


FORMAT = ParquetFormat()
