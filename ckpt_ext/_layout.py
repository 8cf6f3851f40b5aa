"""The fused layers' layout as C++ defines it (csrc/layers/{bert,gpt2,llama}.cpp; llama.cpp also holds qwen3,
gemma, gemma3 and gemma2): family ids and the
order of their weight slots. Read here once; nothing in Python restates it."""
from typing import Dict, List, Tuple

from ._extension import load

_C = load()

FAMILIES: Dict[str, Tuple[int, List[str]]] = dict(_C.layer_families())  # {name: (id, weight slots)}
BERT, GPT2, LLAMA, QWEN3, GEMMA, GEMMA3, GEMMA2 = (
    FAMILIES[name][0] for name in ("bert", "gpt2", "llama", "qwen3", "gemma", "gemma3", "gemma2"))
# The rotary decoders (Llama and its relatives): rotary tables (cos, sin) passed to every layer.
DECODERS = frozenset((LLAMA, QWEN3, GEMMA, GEMMA3, GEMMA2))
FAMILY_NAMES: Dict[int, str] = {family_id: name for name, (family_id, _) in FAMILIES.items()}
