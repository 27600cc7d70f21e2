"""`data.format: text` (.txt, .md): a text corpus, a file or a directory of text files, cut into
language-model blocks by the ranks (data/text_blocks.py). A document is a line of a file
(`data.document: line`, blank lines skipped), a whole file (`document: file`), or each file of a
directory. No records, no rows to count: its samples are known once tokenized."""
from __future__ import annotations

from pathlib import Path

from jobspec.data.formats.base import DataFormat, utf8_lines
from jobspec.data.formats.saved import is_saved_dataset
from jobspec.data.records.base import BadRecord
from jobspec.errors import spec_error


class TextFormat(DataFormat):
    name = "text"
    suffixes = (".txt", ".md")
    holds_records = False
    nested = False
    counted = False

    @property
    def described(self) -> str:
        return ("text (its samples are blocks of data.max_length tokens: counted only when "
                "tokenized)")

    def claims(self, source: str) -> bool:
        """A directory of text files (one that is no saved dataset)."""
        path = Path(source)
        try:
            return path.is_dir() and not is_saved_dataset(path)
        except OSError:
            return False

    def files(self, source: str, setting: str = "auto") -> list[Path]:
        return text_files(source, setting) if self.claims(source) else [Path(source)]

    def check_documents(self, path: Path, split: str, max_bytes: int | None,
                        may_be_empty: bool = False) -> None:
        """A text file: valid UTF-8 (its first `max_bytes`), with at least one non-blank line (a
        file of a directory, `may_be_empty`, may have none: its directory holds the documents)."""
        text = False
        for _, line in utf8_lines(path, split, None, max_bytes):
            text = text or bool(line.strip())
        if not text and not may_be_empty:
            raise BadRecord(("data", split), f"{path} has no text",
                            "a text file needs at least one non-blank line")

    def documents(self, source: str, setting: str, document: str, split: str) -> list[str]:
        """The documents of a text file or a directory of text files, in order (`setting`:
        data.format)."""
        if self.claims(source):
            files = text_files(source, setting)
            if not files:
                raise spec_error(f"{source} holds no {'/'.join(self.suffixes)} files",
                                 path=("data", split),
                                 hint="point it at a directory of text files, or at a data file")
            return [doc for doc in (_read(path, split) for path in files) if doc.strip()]
        text = _read(Path(source), split)
        if document == "file":
            return [text] if text.strip() else []
        return [line for line in text.splitlines() if line.strip()]


def text_files(directory: str | Path, setting: str = "auto") -> list[Path]:
    """A directory's documents, one per file, in sorted path order: its .txt/.md files at any depth
    (with `data.format: text`, every file), hidden files and directories left out."""
    root = Path(directory)
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).parts
        if any(part.startswith(".") for part in relative) or not path.is_file():
            continue
        if setting == FORMAT.name or path.suffix.lower() in FORMAT.suffixes:
            found.append(path)
    return found


def _read(path: Path, split: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8") from None   # located by line in data/loaders.py
    except OSError as err:
        raise spec_error(f"cannot read {path} ({err.strerror or err})", path=("data", split),
                         hint="check the path and its permissions") from None


FORMAT = TextFormat()
