"""Export the tokenizer a GGUF embeds as Hugging Face files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json)."""

from __future__ import annotations

import json
from pathlib import Path

from trtbuild.builder.convert.gguf_reader import _fields, _open
from trtbuild.errors import CheckpointError


def _ensure_post_processor(tokenizer_json: Path, bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> None:
    """Make the plain `tokenizers` library add BOS/EOS the way the GGUF asks (add_bos_token / add_eos_token)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = tok.encode("a").ids
    if (bos is None or (ids and ids[0] == bos[1])) and (eos is None or (ids and ids[-1] == eos[1])):
        return
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    specials = [s for s in (bos, eos) if s is not None]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
    tok.post_processor = template if tok.post_processor is None else processors.Sequence([tok.post_processor, template])
    tok.save(str(tokenizer_json))


def export_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for the GGUF's embedded tokenizer."""
    path, out_dir = Path(path), Path(out_dir)
    meta = _fields(_open(path))
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path} has no embedded tokenizer (tokenizer.ggml.tokens); pass a tokenizer directory.")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    except Exception as exc:  # transformers raises many types for unsupported tokenizer models
        raise CheckpointError(
            f"Could not convert the tokenizer embedded in {path} ({type(exc).__name__}: {exc}). "
            f"Its tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; pass an HF tokenizer directory instead."
        ) from None
    if not (out_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"transformers did not produce tokenizer.json for {path}; pass an HF tokenizer instead.")

    def special(kind: str) -> tuple[str, int] | None:
        idx = meta.get(f"tokenizer.ggml.{kind}_token_id")
        return (tokens[idx], int(idx)) if idx is not None and 0 <= idx < len(tokens) else None

    bos = special("bos") if meta.get("tokenizer.ggml.add_bos_token", False) else None
    eos = special("eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    _ensure_post_processor(out_dir / "tokenizer.json", bos, eos)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for key in ("is_local", "local_files_only"):  # artefacts of how we loaded it, not properties of the tokenizer
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    smap = out_dir / "special_tokens_map.json"
    if not smap.is_file():
        names = {
            f"{k}_token": special(g)
            for k, g in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        }
        smap.write_text(json.dumps({k: v[0] for k, v in names.items() if v is not None}, indent=2) + "\n")
