"""Calibration text: the default corpus (Python standard-library docstrings) or a user's file or folder, tokenized
and cut into equal-length samples."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import warnings
from pathlib import Path

import torch

from trtbuild.errors import ConfigError, TrtbuildError

log = logging.getLogger(__name__)

# Fixed list, fixed order: the default corpus is the same on every machine with the same Python version.
DEFAULT_CORPUS_MODULES = (
    "collections", "itertools", "functools", "pathlib", "os", "json", "re", "string", "textwrap", "argparse",
    "subprocess", "threading", "datetime", "calendar", "decimal", "fractions", "statistics", "random", "heapq",
    "bisect", "typing", "dataclasses", "logging", "unittest", "difflib", "inspect", "pickle", "csv", "zipfile",
    "tarfile", "shutil", "tempfile", "socket", "email.message", "http.client", "urllib.parse", "urllib.request",
    "xml.etree.ElementTree", "codecs", "io", "enum", "contextlib", "abc", "math", "operator", "copy", "pprint",
    "weakref", "types", "builtins", "asyncio.events", "asyncio.tasks", "sqlite3", "configparser", "gettext",
    "locale", "queue", "sched", "selectors", "struct", "hashlib", "hmac", "secrets", "base64", "binascii",
    "html.parser", "mailbox", "ftplib", "smtplib", "imaplib", "uuid", "ipaddress", "glob", "fnmatch", "filecmp",
    "tokenize", "ast", "dis", "traceback", "warnings", "trace", "timeit", "cProfile", "pstats", "doctest",
)


def default_corpus() -> list[str]:
    """Docstrings of the standard library modules above (module, then its classes, functions and methods in
    name order), each document once: real English technical prose that every Python installation has."""
    docs: list[str] = []
    seen: set[str] = set()

    def add(obj: object) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in DEFAULT_CORPUS_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:  # e.g. a Python built without sqlite3
                continue
            add(module)
            for attr in sorted(vars(module)):
                obj = vars(module)[attr]
                if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                    continue
                if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                    continue
                add(obj)
                if inspect.isclass(obj):  # methods defined in the class (not ones other packages patch in)
                    for member in sorted(vars(obj)):
                        method = vars(obj)[member]
                        qualname = getattr(method, "__qualname__", "")
                        if not member.startswith("_") and inspect.isroutine(method) and qualname.startswith(
                                f"{obj.__qualname__}."):
                            add(method)
    return docs


def read_calibration_texts(path: Path | None) -> list[str]:
    """Documents of a calibration source: None (default corpus), a .jsonl file (field "text"), a folder of .txt
    files, or any other text file (one document)."""
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.exists():
        raise ConfigError("calib_dataset", f"{path} does not exist.")
    try:
        if path.is_dir():
            files = sorted(path.rglob("*.txt"))
            if not files:
                raise ConfigError("calib_dataset", f"folder {path} has no .txt files.")
            texts = [f.read_text(encoding="utf-8") for f in files]
        elif path.suffix.lower() == ".jsonl":
            texts = _read_jsonl(path)
        else:
            texts = [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError as e:
        raise ConfigError("calib_dataset", f"{path} is not UTF-8 text ({e}).") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ConfigError("calib_dataset", f"{path} has no text; give a non-empty .txt, .jsonl or folder of .txt.")
    return texts


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("calib_dataset", f"{path} line {number} is not JSON ({e}).") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ConfigError("calib_dataset", f'{path} line {number} has no string field "text".')
        texts.append(record["text"])
    return texts


def calibration_samples(texts: list[str], tokenizer_dir: Path, vocab_size: int, calib_size: int,
                        max_seq_len: int) -> torch.Tensor:
    """[n, max_seq_len] int64 token ids: the documents tokenized (special tokens as the tokenizer adds them),
    concatenated, cut into windows of max_seq_len and `calib_size` windows taken evenly over the whole text."""
    from trtbuild.runtime.tokenizer import Tokenizer

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise TrtbuildError(f"{tokenizer_dir} has no tokenizer.json; calibration needs the model's tokenizer "
                            "(HF folders must include it).")
    tokenizer = Tokenizer(Path(tokenizer_dir))
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text)
    if ids and max(ids) >= vocab_size:
        raise TrtbuildError(f"the tokenizer produced token id {max(ids)} but the model has vocab_size {vocab_size}; "
                            "the tokenizer does not belong to the model.")
    if not ids:
        raise TrtbuildError("the calibration text tokenized to no tokens.")
    windows = max(1, len(ids) // max_seq_len)
    length = min(max_seq_len, len(ids))
    n = min(calib_size, windows)
    if n < calib_size:
        log.warning("calibration text has %d tokens: %d samples of %d tokens instead of --calib-size %d",
                    len(ids), n, length, calib_size)
    starts = [(i * windows // n) * length for i in range(n)]
    return torch.tensor([ids[s: s + length] for s in starts], dtype=torch.int64)
