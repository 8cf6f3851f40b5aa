"""Does Hugging Face hand SDPA an attention mask under torch.compile where it hands none eagerly? (issue 35)

With no mask, SDPA can run its flash kernel on a GPU; with a materialized [B, 1, S, S] mask it cannot (the
memory-efficient or cuDNN kernel with a bias, or the math path), and the attention runs slower. transformers
decides at the call whether the mask can be dropped (`masking_utils`: no padding, no local window); that check reads
the mask's values, which it does not do while Dynamo traces. Prints, for a tiny BERT (bidirectional) and Llama
(causal) of the installed transformers, what `scaled_dot_product_attention` receives eagerly and compiled (backend
"eager": Dynamo's trace, no inductor), without an attention_mask and with an all-ones one. CPU, a few seconds:

    python tools/repro_compile_mask.py

2026-11-27, torch 2.13 CPU: transformers 5.17 (the GPU image's) materializes the mask under compile even without an
attention_mask; 5.18 and later drop it there, but still materialize an all-ones attention_mask passed under
compile (eagerly both are dropped). docs/compile.md, "What Hugging Face hands SDPA under compile".
"""
import torch
import torch.nn.functional as F
import transformers

_seen = []
_sdpa = F.scaled_dot_product_attention


def _spy(q, k, v, attn_mask=None, *args, **kwargs):
    _seen.append("none" if attn_mask is None else f"{list(attn_mask.shape)} {str(attn_mask.dtype).replace('torch.', '')}")
    return _sdpa(q, k, v, attn_mask, *args, **kwargs)


def _install_spy() -> None:
    F.scaled_dot_product_attention = _spy
    try:  # transformers' SDPA integration calls it through its own module reference
        import transformers.integrations.sdpa_attention as sdpa_attention
        sdpa_attention.torch.nn.functional.scaled_dot_product_attention = _spy
    except ImportError:
        pass


def _models():
    small = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                 attn_implementation="sdpa")
    yield "bert", transformers.BertModel(transformers.BertConfig(**small), add_pooling_layer=False)
    yield "llama", transformers.LlamaModel(transformers.LlamaConfig(num_key_value_heads=2, **small))


def probe() -> dict:
    """{(model, 'eager'|'compiled', 'no mask'|'all-ones mask'): what SDPA received in the layer}."""
    _install_spy()
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 16))
    out = {}
    for name, model in _models():
        model.train()
        compiled = torch.compile(model, backend="eager")
        for mode, m in (("eager", model), ("compiled", compiled)):
            for what, kwargs in (("no mask", {}), ("all-ones mask", {"attention_mask": torch.ones_like(ids)})):
                _seen.clear()
                m(input_ids=ids, **kwargs).last_hidden_state.sum().backward()
                out[(name, mode, what)] = ", ".join(_seen) or "(no SDPA call)"
        torch._dynamo.reset()
    return out


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: the mask SDPA receives")
    for (name, mode, what), got in probe().items():
        print(f"  {name:5s} {mode:8s} {what:13s} -> {got}")


if __name__ == "__main__":
    main()
