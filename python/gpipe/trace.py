"""Any torch.nn.Module as a Sequential of pieces that gpipe cuts into stages: traced with torch.fx.

    graph = trace(model)                                # when GPipe(model) is built
    pieces, paths = split(graph, value_kinds(graph, x))  # on its first batch x

The model's forward is traced into one graph (fx's symbolic tracing), its submodules' forwards
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
import threading
import traceback
import typing
import warnings

import torch
import torch.fx

# Factory functions given a traced value (torch.arange(0, x.size(1))) take no tensor, so fx's tracing
# does not see them: they are recorded as calls while a model is traced (called as torch.NAME).
_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "eye", "linspace", "rand", "randn", "randint")

# A trace patches torch's factories and fx's Proxy for its length: one at a time.
_TRACING = threading.Lock()


class _Tracer(torch.fx.Tracer):
    """fx's tracer that inlines every submodule it can, keeps `leaves` whole, reads buffers as graph
    values (self.mask[:, :t]), unpacks a traced size (b, t = x.size()) and records factories."""
    proxy_buffer_attributes = True

    def __init__(self, leaves):
        super().__init__(autowrap_modules=(math,))
        self.leaves = leaves
        self.failed_in = None  # the innermost module whose forward could not be traced

    def is_leaf_module(self, module, qualified_name):
        return qualified_name in self.leaves or reads_its_mode(module) or \
            super().is_leaf_module(module, qualified_name)

    def call_module(self, module, forward, args, kwargs):
        name = self.path_of_module(module)
        try:
            return super().call_module(module, forward, args, kwargs)
        except Exception:
            if self.failed_in is None and not self.is_leaf_module(module, name):
                self.failed_in = name
            raise

    def iter(self, value):
        # `a, b = x.size()`: as many items as the code unpacks (torch 1.13's own reading of the
        # instruction misses Python 3.11's bytecode). Called by Proxy.__iter__, from the user's frame.
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

        with _TRACING:
            originals = {name: getattr(torch, name) for name in _FACTORIES}
            proxy_iter = torch.fx.Proxy.__iter__
            try:
                for name, fn in originals.items():
                    setattr(torch, name, recorded(fn))
                torch.fx.Proxy.__iter__ = lambda proxy: proxy.tracer.iter(proxy)
                return super().trace(root, concrete_args)
            finally:
                torch.fx.Proxy.__iter__ = proxy_iter
                for name, fn in originals.items():
                    setattr(torch, name, fn)


def reads_its_mode(module):
    """Whether the module's forward reads self.training (F.dropout(x, p, self.training), a branch),
    which a trace would freeze at the mode it was traced in: such a module is kept whole."""
    forward = getattr(type(module).forward, "__code__", None)
    return forward is not None and "training" in forward.co_names


def _defaults(model):
    """The defaults of the forward's arguments after the first: fx traces them as constants."""
    parameters = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in parameters) or \
            any(p.default is p.empty for p in parameters[1:]):
        raise ValueError(f"gpipe: the model's forward takes {str(inspect.signature(model.forward))}; gpipe gives it "
                         f"one tensor, the batch, and traces the others at their defaults: give a model whose forward "
                         f"takes one tensor, others positional with defaults (no *args, keyword-only or **kwargs), "
                         f"or a torch.nn.Sequential")
    return {p.name: p.default for p in parameters[1:]}


def _inline_defaults(graph, defaults):
    """fx makes each argument given in concrete_args a placeholder checked against its value (an
    assertion node); the value itself is put where it is read, and both go."""
    checks = (torch.fx._symbolic_trace._assert_is_none, torch._assert)
    for node, value in zip([n for n in graph.nodes if n.op == "placeholder"][1:], defaults.values()):
        for user in list(node.users):
            if user.op == "call_function" and user.target in checks and not user.users:
                graph.erase_node(user)
            else:
                user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
        graph.erase_node(node)
    for check in [n for n in graph.nodes if n.op == "call_function" and n.target in checks]:
        condition = check.args[0] if check.args else None
        if isinstance(condition, torch.fx.Node) and condition.target is operator.eq and not condition.all_input_nodes:
            graph.erase_node(check)  # a default compared with itself
            if not condition.users:
                graph.erase_node(condition)


def check_path(model, path, what):
    """Refuses `path` unless it names a submodule of `model`."""
    try:
        if not isinstance(path, str) or not path:
            raise AttributeError
        model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"gpipe: {what} names {path!r}, which is not a submodule's path in the model; give paths "
                         f"as model.named_modules() names them (e.g. 'blocks.2')") from None


def trace(model, keep_whole=()):
    """The model's forward as a torch.fx.GraphModule over the model's own submodules and tensors:
    every submodule whose forward fx can trace is inlined; one it cannot (data-dependent control
    flow) and those named in `keep_whole` (module paths) are kept whole, as one layer. Raises
    ValueError with fx's reason where the model's own forward cannot be traced."""
    leaves = set()
    for path in keep_whole:
        check_path(model, path, "keep_whole")
        leaves.add(path)
    from .skip import Pop, Stash
    for name, module in model.named_modules():
        if isinstance(module, (Stash, Pop)):
            raise ValueError(f"gpipe: {name!r} is a gpipe.{type(module).__name__}, which connects layers of a "
                             f"torch.nn.Sequential; in a model gpipe traces, a value read later travels there by "
                             f"itself: read it where it is needed, without Stash and Pop")
    if reads_its_mode(model):
        raise ValueError(f"gpipe: {type(model).__name__}'s forward reads self.training, which a trace would freeze "
                         f"in the mode it is traced in (model.train() or eval() would then change nothing): move the "
                         f"code that depends on the mode into a submodule, which gpipe keeps whole, or give a "
                         f"torch.nn.Sequential of the layers")
    defaults = _defaults(model)
    while True:
        tracer = _Tracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=defaults)
            break
        except Exception as e:
            if tracer.failed_in is None:  # the model's own forward
                raise ValueError(
                    f"gpipe: the model's forward cannot be traced by torch.fx, which gpipe needs to cut a model that "
                    f"is not a torch.nn.Sequential: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    f"{_user_line(e)}. Ways out: give GPipe(model, keep_whole=[...]) the paths of the submodules "
                    f"whose code fx cannot follow (they are then run whole, as one layer), or give a "
                    f"torch.nn.Sequential of the layers") from None
            leaves.add(tracer.failed_in)
    _inline_defaults(graph, defaults)
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    if not isinstance(returned, torch.fx.Node):
        _refuse_output(returned)
    if not _computing(graph):
        raise ValueError("gpipe: the model's forward computes nothing from its input (it returns the input or a "
                         "constant): there is nothing to pipeline")
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    for path in keep_whole:
        if path not in called:
            raise ValueError(f"gpipe: keep_whole names {path!r}, which the forward never calls as a whole (a "
                             f"container such as a ModuleList is not called; name the modules it holds)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not used")
        return torch.fx.GraphModule(model, graph, class_name=type(model).__name__)


def _refuse_output(value):
    kind = next((k.__name__ for k in (dict, tuple, list) if isinstance(value, k)), type(value).__name__)
    raise ValueError(f"gpipe: the model returns {'an' if kind[0] in 'aeiou' else 'a'} {kind}, where gpipe needs one tensor, the output its loss "
                     f"takes; return the tensor (e.g. the logits) from forward")


def _user_line(error):
    """' (at file.py:12: x = ...)' for the innermost frame of the error outside torch; '' if none."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
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
    """Which of the graph's values are tensors, from one run without a graph on a copy of `example`
    (on the model's device), its buffers and random numbers left as they were."""
    first = next(graph_module.parameters(), None)
    example = example.clone() if first is None else example.to(first.device, copy=True)
    buffers = [(b, b.detach().clone()) for b in graph_module.buffers()]
    devices = [example.device.index or 0] if example.is_cuda else []
    kinds = _Kinds(graph_module)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            output = kinds.run(example)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    if not isinstance(output, torch.Tensor):
        _refuse_output(output)
    return kinds.tensor


def _module_path(node, parameters):
    """The module a layer call runs: its own, or the one that holds the parameter it is given; None
    for any other node."""
    if node.op == "call_module":
        return node.target
    if node.op in ("call_function", "call_method"):
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a.target in parameters:
                return a.target.rpartition(".")[0] or a.target
    return None


def _computing(graph):
    """The graph's nodes that compute (not its input, its output, or its reads of parameters)."""
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _alive(graph, nodes):
    """Per position k of `nodes`, the values made before nodes[k] and read at or after it, in order."""
    at = {n: k for k, n in enumerate(nodes)}
    last = {n: max((at.get(u, len(nodes)) for u in n.users), default=-1)
            for n in graph.nodes if n.op not in ("get_attr", "output")}
    alive, made = [], [n for n in graph.nodes if n.op == "placeholder"]
    for k, node in enumerate(nodes):
        made = [v for v in made if last[v] >= k]
        alive.append(list(made))
        made.append(node)
    return alive


def _piece(graph_module, nodes, inputs, outputs):
    """A GraphModule of `nodes` taking `inputs` (one tensor, or a tuple) and returning `outputs`."""
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
            env[n] = graph.get_attr(n.target)
        return env[n]

    for node in nodes:
        env[node] = graph.node_copy(node, value)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[v] for v in outputs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not used")
        return torch.fx.GraphModule(graph_module, graph, class_name="Piece")


def split(graph_module, kinds):
    """The graph as a torch.nn.Sequential of pieces, one starting at each layer call with only
    tensors alive before it (`kinds`: value_kinds'); and the module path each piece starts at
    (the first piece: its first module's, or "input" where it calls none)."""
    graph = graph_module.graph
    parameters = dict(graph_module.named_parameters())
    nodes = _computing(graph)
    alive = _alive(graph, nodes)
    paths = [_module_path(n, parameters) for n in nodes]
    starts = [k for k in range(1, len(nodes))
              if paths[k] is not None and alive[k] and all(kinds.get(v, False) for v in alive[k])]
    bounds = [0] + starts + [len(nodes)]
    output = next(n for n in graph.nodes if n.op == "output")
    pieces, names = collections.OrderedDict(), []
    for begin, end in zip(bounds, bounds[1:]):
        names.append(next((p for p in paths[begin:end] if p is not None), "input"))
        # Named by index, as a Sequential's layers are (each rank of an MPI job finds its layers so).
        pieces[str(len(pieces))] = _piece(
            graph_module, nodes[begin:end], alive[begin], [output.args[0]] if end == len(nodes) else alive[end])
    return torch.nn.Sequential(pieces), names


def balance_at(paths, split_points):
    """Pieces per stage where stages begin at `split_points` (module paths): each at the first piece
    after the previous split point's that starts at that module or inside it."""
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
    return max(1, len(_computing(graph_module.graph)))
