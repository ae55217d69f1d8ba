"""Any torch.nn.Module as a Sequential of pieces that gpipe cuts into stages: traced with torch.fx.

    pieces = gpipe.trace.pieces(model, example)   # a torch.nn.Sequential; GPipe(model) does this itself

The model's forward is traced into one graph (torch.fx.symbolic_trace), its submodules' forwards
inlined, down to torch.nn's own layers and the submodules fx cannot trace (kept whole, as one
layer). The graph is then cut into consecutive pieces, one starting at each layer call (a module
call, or a function given a parameter) where only tensors are alive across the cut: the values
computed before it and read after it. Each piece takes those tensors as its input (one tensor, or
a tuple) and hands on the ones alive after it, so a value read several pieces later travels
through the pieces between. A value that is not a tensor (a size, a device) never crosses a cut:
where one is alive, no piece starts. The pieces hold the model's own submodules, parameters and
buffers, so training them trains the model, and a parameter read in two pieces (a head tied to the
embedding) is one weight that two layers share.
"""
import collections
import dis
import functools
import inspect
import math
import operator
import typing
import warnings

import torch
import torch.fx

# Factory functions given a traced value (torch.arange(0, x.size(1))) take no tensor, so fx's tracing
# does not see them: they are recorded as calls while a model is traced.
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "linspace", "rand", "randn", "randint")


class _Tracer(torch.fx.Tracer):
    """fx's tracer that inlines every submodule it can, keeps `leaves` whole, reads buffers as graph
    values (self.mask[:, :t]), unpacks a traced size (b, t = x.size()) and records factories."""
    proxy_buffer_attributes = True

    def __init__(self, leaves):
        super().__init__(autowrap_modules=(math,))
        self.leaves = leaves
        self.failed_in = None  # the innermost module whose forward could not be traced

    def is_leaf_module(self, module, qualified_name):
        return qualified_name in self.leaves or super().is_leaf_module(module, qualified_name)

    def call_module(self, module, forward, args, kwargs):
        name = self.path_of_module(module)
        try:
            return super().call_module(module, forward, args, kwargs)
        except Exception:
            if self.failed_in is None and not self.is_leaf_module(module, name):
                self.failed_in = name
            raise

    def iter(self, value):
        # `a, b = x.size()`: Python unpacks the traced value into as many items as the code names
        # (torch 1.13's own check of the instruction misreads Python 3.11's bytecode).
        frame = inspect.currentframe().f_back.f_back
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset == frame.f_lasti:
                if instruction.opname == "UNPACK_SEQUENCE":
                    return iter([value[i] for i in range(instruction.argval)])
                break
        return super().iter(value)

    def trace(self, root, concrete_args=None):
        def recorded(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                traced = []
                torch.fx.node.map_aggregate((args, kwargs), lambda a: traced.append(a)
                                            if isinstance(a, torch.fx.Proxy) else None)
                return self.create_proxy("call_function", fn, args, kwargs) if traced else fn(*args, **kwargs)
            return call

        originals = {name: getattr(torch, name) for name in _FACTORIES}
        try:
            for name, fn in originals.items():
                setattr(torch, name, recorded(fn))
            return super().trace(root, concrete_args)
        finally:
            for name, fn in originals.items():
                setattr(torch, name, fn)


def _one_input(model):
    """fx's concrete_args for a forward of one tensor and optional others: those left at their defaults."""
    parameters = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional or any(p.kind == p.VAR_POSITIONAL for p in parameters) or \
            any(p.default is p.empty for p in positional[1:]):
        raise ValueError(f"gpipe: the model's forward takes {str(inspect.signature(model.forward))}; gpipe gives it "
                         f"one tensor, the batch: give a model whose forward takes one tensor (others with defaults)")
    return {p.name: p.default for p in parameters[1:] if p.kind != p.VAR_KEYWORD}


def trace(model, keep_whole=()):
    """The model's forward as a torch.fx.GraphModule over the model's own submodules and tensors:
    every submodule whose forward fx can trace is inlined; one it cannot (data-dependent control
    flow) and those named in `keep_whole` (module paths) are kept whole, as one layer. Raises
    ValueError with fx's reason where the model's own forward cannot be traced."""
    leaves = set()
    for path in keep_whole:
        check_path(model, path, "keep_whole")
        leaves.add(path)
    concrete = _one_input(model)
    while True:
        tracer = _Tracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=concrete)
            break
        except Exception as e:
            if tracer.failed_in is None:  # the model's own forward
                where = _user_line(e)
                raise ValueError(
                    f"gpipe: the model's forward cannot be traced by torch.fx, which gpipe needs to cut a model that "
                    f"is not a torch.nn.Sequential: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    f"{where}. Ways out: give GPipe(model, keep_whole=[...]) the paths of the submodules whose code "
                    f"fx cannot follow (they are then run whole, as one layer), or give a torch.nn.Sequential of "
                    f"the layers") from None
            leaves.add(tracer.failed_in)
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    if not isinstance(returned, torch.fx.Node):
        _refuse_output(returned)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not used")
        return torch.fx.GraphModule(model, graph, class_name=type(model).__name__)


def _refuse_output(value):
    kind = next((k.__name__ for k in (dict, tuple, list) if isinstance(value, k)), type(value).__name__)
    raise ValueError(f"gpipe: the model returns a {kind}, where gpipe needs one tensor, the output "
                     f"its loss takes; return the tensor (e.g. the logits) from forward")


def _user_line(error):
    """' (file.py:12: x = ...)' for the innermost frame of the error outside torch; '' if none."""
    frames = [f for f in __import__("traceback").extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith("gpipe/trace.py")]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}: {(f.line or '').strip()})"


class _Kinds(torch.fx.Interpreter):
    """Runs the graph once, noting which values are tensors."""

    def __init__(self, module):
        super().__init__(module)
        self.tensor = {}

    def run_node(self, node):
        value = super().run_node(node)
        self.tensor[node] = isinstance(value, torch.Tensor)
        return value


def value_kinds(graph_module, example):
    """Which of the graph's values are tensors, from one run on `example` without a graph, the
    model's buffers and the random numbers left as they were."""
    buffers = [(b, b.detach().clone()) for b in graph_module.buffers()]
    kinds = _Kinds(graph_module)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        output = kinds.run(example)
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    if not isinstance(output, torch.Tensor):
        _refuse_output(output)
    return kinds.tensor


def _reads_a_parameter(node, parameters):
    return any(a.op == "get_attr" and a.target in parameters for a in node.all_input_nodes)


def _module_path(node, parameters):
    if node.op == "call_module":
        return node.target
    for a in node.all_input_nodes:
        if a.op == "get_attr" and a.target in parameters:
            return a.target.rpartition(".")[0] or a.target
    return None


def cuts(graph_module, kinds):
    """Where pieces may start: (index of the node in the graph's computing nodes, module path) for
    each layer call with only tensors alive before it; and those nodes."""
    nodes = [n for n in graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    at = {n: k for k, n in enumerate(nodes)}
    last_use = {}
    for n in graph_module.graph.nodes:
        if n.op == "get_attr":
            continue
        uses = [at.get(u, len(nodes)) for u in n.users]
        last_use[n] = max(uses, default=-1)
    parameters = dict(graph_module.named_parameters())
    found = []
    alive = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    for k, node in enumerate(nodes):
        alive = [v for v in alive if last_use[v] >= k]
        if k > 0 and alive and all(kinds.get(v, False) for v in alive):
            path = _module_path(node, parameters)
            if path is not None:
                found.append((k, path))
        alive.append(node)
    return found, nodes


def _piece(graph_module, nodes, inputs, outputs):
    """A GraphModule of `nodes` taking `inputs` (one tensor, or a tuple of them) and returning `outputs`."""
    graph = torch.fx.Graph()
    env = {}
    if len(inputs) == 1:
        env[inputs[0]] = graph.placeholder("x", type_expr=torch.Tensor)
    else:
        values = graph.placeholder("values", type_expr=typing.Tuple[(torch.Tensor,) * len(inputs)])
        for k, v in enumerate(inputs):
            env[v] = graph.call_function(operator.getitem, (values, k))

    def value(n):
        if n not in env:  # a parameter or buffer: read again in each piece that reads it
            assert n.op == "get_attr", n
            env[n] = graph.get_attr(n.target)
        return env[n]

    for node in nodes:
        for a in node.all_input_nodes:
            value(a)
        env[node] = graph.node_copy(node, value)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[v] for v in outputs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not used")
        return torch.fx.GraphModule(graph_module, graph, class_name="Piece")


def split(graph_module, kinds, starts=None):
    """The graph as a torch.nn.Sequential of pieces, one starting at each of `starts` (node indices
    among cuts(); all of them by default); and the module path each piece starts at."""
    found, nodes = cuts(graph_module, kinds)
    if starts is None:
        starts = [k for k, _ in found]
    paths = dict(found)
    bounds = [0] + sorted(starts) + [len(nodes)]
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    at = {n: k for k, n in enumerate(nodes)}
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    parameters = dict(graph_module.named_parameters())

    def alive_at(k):  # values made before node k and read at or after it, in the graph's order
        made = placeholders + nodes[:k]
        return [v for v in made if any(at.get(u, len(nodes)) >= k for u in v.users)]

    pieces = collections.OrderedDict()
    names = []
    for begin, end in zip(bounds, bounds[1:]):
        inputs = alive_at(begin)
        outputs = [output.args[0]] if end == len(nodes) else alive_at(end)
        name = paths.get(begin) or next((_module_path(n, parameters) for n in nodes[begin:end]
                                         if _module_path(n, parameters)), "input")
        names.append(name)
        pieces[name.replace(".", "_") + ("" if name.replace(".", "_") not in pieces else f"_{len(names)}")] = \
            _piece(graph_module, nodes[begin:end], inputs, outputs)
    return torch.nn.Sequential(pieces), names


def balance_at(paths, split_points):
    """Pieces per stage where stages begin at `split_points` (module paths): each at the first piece
    after the last one that starts at that module or inside it."""
    at = [0]
    for point in split_points:
        found = next((k for k in range(at[-1] + 1, len(paths))
                      if paths[k] == point or paths[k].startswith(point + ".")), None)
        if found is None:
            raise ValueError(
                f"gpipe: no piece starts at {point!r} after {paths[at[-1]]!r}, so no stage can begin there: give "
                f"split_points in the order of the forward, each a module whose call has only tensors alive before "
                f"it; the pieces start at {', '.join(paths)}")
        at.append(found)
    at.append(len(paths))
    return [b - a for a, b in zip(at, at[1:])]


def most_pieces(graph_module):
    """An upper bound of the pieces the graph is cut into (its computing nodes), known before the first batch."""
    return max(1, sum(1 for n in graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")))


def check_path(model, path, what):
    if path not in dict(model.named_modules()) or not path:
        raise ValueError(f"gpipe: {what} names {path!r}, which is not a submodule's path in the model; give paths "
                         f"as model.named_modules() names them (e.g. 'blocks.2')")
