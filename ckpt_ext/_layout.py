"""The fused layers' layout as C++ defines it (csrc/layers/{bert,gpt2,llama}.cpp): family ids and the
order of their weight slots. Read here once; nothing in Python restates it."""
from typing import Dict, List, Tuple

from ._extension import load

_C = load()

FAMILIES: Dict[str, Tuple[int, List[str]]] = dict(_C.layer_families())  # {name: (id, weight slots)}
BERT, GPT2, LLAMA = (FAMILIES[name][0] for name in ("bert", "gpt2", "llama"))
FAMILY_NAMES: Dict[int, str] = {family_id: name for name, (family_id, _) in FAMILIES.items()}
