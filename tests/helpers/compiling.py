"""torch.compile test helpers: a backend that records the graphs it is handed."""
from torch._dynamo.backends.debugging import aot_eager


class Recorder:
    """A torch.compile backend: aot_eager, keeping the graphs Dynamo hands it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def count(self, name: str) -> int:
        """Calls of the function or operator `name` in the recorded graphs."""
        return sum(getattr(n.target, "__name__", None) == name or str(n.target) in (name, name + ".default")
                   for g in self.graphs for n in g.graph.nodes if n.op == "call_function")
