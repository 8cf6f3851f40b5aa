"""What tests/test_lifecycle.py shares with the process it spawns: one seeded training step and its
gradients (the spawned process imports this module by name, so it lives here, not in the test file)."""
import io

import torch


def training_step(model, kw, seed=0):
    """One training step from `seed`: loss = sum of squares of the last hidden state (or the stack's
    output); returns {name: grad} (clones; the model's grads are cleared)."""
    model.train()
    torch.manual_seed(seed)
    out = model(**kw) if isinstance(kw, dict) else model(kw)
    hidden = out if isinstance(out, torch.Tensor) else out[0]
    hidden.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def saved_tensor_count(model, kw, seed=0):
    """How many tensors autograd saves outside ckpt_ext's checkpoints in one forward: fewer when layers are
    checkpointed (their insides are saved by ckpt_ext's own hooks or not at all)."""
    count = [0]

    def pack(t):
        count[0] += 1
        # Detached: a node's own output packed as itself would hold its grad_fn, a cycle through C++ that
        # Python's gc cannot see (torch's identity pack hooks leak so); the forward here is never backpropagated.
        return t.detach()

    model.train()
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**kw) if isinstance(kw, dict) else model(kw)
    return count[0]


def round_trip(model, how):
    """The model through torch.save/torch.load(weights_only=False) or pickle."""
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    import pickle
    return pickle.loads(pickle.dumps(model))


def train_in_spawned_process(rank, model, kw, out_path):
    """torch.multiprocessing.spawn's target: the model arrived pickled; its training step's gradients, whether
    checkpointing is still enabled, and its explanation go back through a file."""
    import ckpt_ext
    from ckpt_ext.stack import is_enabled
    grads = training_step(model, kw)
    torch.save({"grads": grads, "enabled": is_enabled(model), "explain": str(ckpt_ext.explain(model)),
                "saved": saved_tensor_count(model, kw)}, out_path)
