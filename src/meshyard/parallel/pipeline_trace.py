"""Pipeline stages of a model meshyard has never seen, cut from a trace of its own forward.

meshyard's GPT is cut by hand (``pipeline.GPTStage``). Any other model is traced whole
by ``torch.distributed.pipelining.pipeline`` (``torch.export`` underneath) with a split
point before the first block of every stage but the first, so its forward runs as the
user wrote it (a loop over a ModuleList inside a ModuleDict, a Hugging Face decoder):
what runs before the first block (embeddings, rotary tables, masks) lands on the first
stage, what runs after the last block (final norm, head) on the last one. Whatever a
later stage needs from an earlier one (the residual stream, rotary cos/sin, the mask)
reaches it through the stages in between (``_chain``), and torch's traced pipeline stage
(``pipelining.stage.build_stage``) reads from the pipeline graph what to send and receive.
Regions the forward runs under ``no_grad`` or ``autocast`` are inlined before the cut
(``_prepare``): torch's outlining of stage modules mistakes their bodies for modules.

The model is traced inside ``LogitsOf``, which returns the logits of whatever the
forward returns (a Hugging Face ``ModelOutput`` included), so the last stage ends in
the tensor the loss reads. Stage modules keep the model's qualified names under the
wrapper's ``model.`` prefix (``model.transformer.h.5``), and each outlined module records
its original class in its graph, which is how ``units`` finds the blocks inside a stage.

A trace fixes what the forward decided in Python while it ran: the shapes of one
pipeline micro-batch (every micro-batch of a run has them) and training-mode choices
(dropout also runs in evaluation). Stages hold plain tensors: tensor parallelism inside
them is not supported (head counts are constants of the graph).
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Collection, Iterator

import torch
from torch import fx, nn
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
from torch.distributed.pipelining import Pipe, pipeline
from torch.distributed.pipelining._IR import PipeInfo
from torch.torch_version import TorchVersion

from meshyard.models.outputs import logits_of

PREFIX = "model"  # LogitsOf's attribute: every traced name starts with it
_GRAD_MODE = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
_PIPE_SPLIT = torch.ops.pippy._pipe_split.default  # what pipeline() cuts at
RECEIVES_NON_FLOAT = TorchVersion(torch.__version__) >= "2.13"
"""Whether torch's traced stages can receive a non-floating activation: before 2.13 a training
stage makes every receive buffer require gradients, which only floating tensors can."""


class PipelineTraceError(ValueError):
    """The model cannot be cut by tracing; the message says what to change."""


class LogitsOf(nn.Module):
    """The user's model, returning the logits tensor of what its forward returns."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(tokens))


@dataclass
class TracedStages:
    """A traced cut: the kept stage modules by index, the pipeline graph their torch
    stages are built from, and per stage (all of them) the model's names of its parameters."""

    modules: dict[int, nn.Module]
    info: PipeInfo
    held: list[set[str]]


def trace_stages(model: nn.Module, cut_before: list[str], keep: Collection[int], example_tokens: torch.Tensor,
                 device: torch.device) -> TracedStages:
    """Trace ``model`` on ``example_tokens`` (one pipeline micro-batch of token ids) and cut
    it before each module named in ``cut_before`` (the first block of every stage after
    the first). Stages in ``keep`` are made ready to run on ``device``; the others are
    dropped. Raises ``PipelineTraceError`` when the model cannot be cut this way."""
    n_stages = len(cut_before) + 1
    tokens = example_tokens.to(_device_of(model))
    with _all_on_meta(model):
        pipe = _trace(model, cut_before, tokens)
    if pipe.num_stages != n_stages:
        raise PipelineTraceError(
            f"parallel.pp: the traced forward of {type(model).__name__} cut into {pipe.num_stages} stages, not "
            f"{n_stages}: it must call each block once, in the order they are registered; give the block class "
            "with parallel.fsdp_units if another module repeats, or train it without pipeline parallelism")
    _check_inputs(pipe, model)
    _chain(pipe)
    _contiguous_boundaries(pipe)
    if not RECEIVES_NON_FLOAT:
        _refuse_non_float_boundaries(pipe, model)
    non_persistent = {_join(path, name) for path, module in model.named_modules()
                      for name in module._non_persistent_buffers_set}
    held, modules = [], {}
    for index in range(n_stages):
        stage = pipe.get_stage_module(index)
        _drop_unused(stage)
        held.append({name.removeprefix(PREFIX + ".") for name, _ in stage.named_parameters()})
        if index not in keep:
            delattr(pipe.split_gm, _child_name(pipe.split_gm, stage))  # frees its memory
            continue
        _restore_persistence(stage, non_persistent)
        _retarget_devices(stage, tokens.device, _indexed(device))
        _release_copies(stage)
        modules[index] = stage
    return TracedStages(modules, pipe.info(), held)


@contextmanager
def _all_on_meta(model: nn.Module) -> Iterator[None]:
    """A model built on the meta device may keep tensors that were built with their values
    (a causal mask) on the real one; the trace needs one device, so those are seen on meta
    while it runs (the stages get their values when materialized, by name)."""
    tensors = [(registry, name, tensor) for module in model.modules()
               for registry in (module._parameters, module._buffers) for name, tensor in registry.items()
               if tensor is not None]
    if not any(t.is_meta for _, _, t in tensors) or all(t.is_meta for _, _, t in tensors):
        yield
        return
    on_meta: dict[int, torch.Tensor] = {}  # by identity: tied tensors stay tied
    for registry, name, tensor in tensors:
        if not tensor.is_meta:
            if id(tensor) not in on_meta:
                moved = tensor.detach().to("meta")
                on_meta[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(
                    tensor, nn.Parameter) else moved
            registry[name] = on_meta[id(tensor)]
    try:
        yield
    finally:
        for registry, name, tensor in tensors:
            registry[name] = tensor


def _trace(model: nn.Module, cut_before: list[str], tokens: torch.Tensor) -> Pipe:
    """``pipeline()`` over ``LogitsOf(model)``, split where ``_prepare`` marks the graph
    (the model itself is left untouched)."""
    traced: list[fx.GraphModule] = []  # filled once torch.export has succeeded

    def prepare(graph: fx.GraphModule) -> fx.GraphModule:
        traced.append(graph)
        return _prepare(graph, cut_before, model)

    try:
        return pipeline(LogitsOf(model), (tokens,), split_policy=prepare)
    except PipelineTraceError:
        raise
    except Exception as failure:
        raise PipelineTraceError(_trace_failure(model, failure, traced=bool(traced))) from failure


def _prepare(traced: fx.GraphModule, cut_before: list[str], model: nn.Module) -> fx.GraphModule:
    """Inline the grad-mode and autocast regions (torch's outlining of stage modules
    mistakes their bodies, held as graph attributes, for module calls), then mark a split
    before the first operation of each block in ``cut_before``."""
    while True:
        region = next((node for node in traced.graph.nodes if node.op == "call_function"
                       and node.target in (_GRAD_MODE, _AUTOCAST)), None)
        if region is None:
            break
        _inline(traced, region)
    nodes = list(traced.graph.nodes)
    starts = [_first_node_of(nodes, f"{PREFIX}.{name}") for name in cut_before]
    positions = [nodes.index(node) if node is not None else -1 for node in starts]
    if min(positions, default=0) < 0 or positions != sorted(positions):
        raise PipelineTraceError(
            f"parallel.pp: the forward of {type(model).__name__} does not run its blocks one after another in the "
            "order they are registered, so it cannot be cut before them; give the block class with "
            "parallel.fsdp_units if another module repeats, or train it without pipeline parallelism")
    for node in starts:
        with traced.graph.inserting_before(node):
            traced.graph.call_function(_PIPE_SPLIT, ())
    traced.recompile()
    return traced


def _call(graph: fx.Graph, target: object, args: tuple, region: fx.Node, like: fx.Node | None = None) -> fx.Node:
    """A new operation, inside the module that ran ``region`` (the outlining needs to know),
    whose value is shaped ``like`` a node's (the stage that receives it reads its shape)."""
    node = graph.call_function(target, args)
    node.meta["nn_module_stack"] = region.meta.get("nn_module_stack")
    if like is not None and "val" in like.meta:
        node.meta["val"] = like.meta["val"]
    return node


def _first_node_of(nodes: list[fx.Node], path: str) -> fx.Node | None:
    """The first operation the module at ``path`` runs."""
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and any(entry[0] == path for entry in stack.values()):
            return node
    return None


def _inline(traced: fx.GraphModule, region: fx.Node) -> None:
    """Replace a grad-mode or autocast region by its body: autocast entered and exited
    around it; under no_grad, its outputs detached (nothing inside needs gradients)."""
    graph = traced.graph
    autocast = region.target is _AUTOCAST
    at = 4 if autocast else 1  # (device_type, dtype, enabled, cache, body, *x) or (enabled, body, *x)
    body = getattr(traced, region.args[at].target)
    operands = iter(region.args[at + 1:])
    env: dict[fx.Node, object] = {}
    outputs: tuple = ()
    with graph.inserting_before(region):
        context = _call(graph, _enter_autocast, tuple(region.args[:4]), region) if autocast else None
        for node in body.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(operands)
            elif node.op == "output":
                outputs = tuple(fx.node.map_arg(node.args[0], lambda n: env[n]))
            else:
                if node.op == "get_attr":  # a nested region's body: move it onto the root
                    name = f"{region.args[at].target}_{node.target}"
                    traced.register_module(name, getattr(body, node.target))
                copy = graph.node_copy(node, lambda n: env[n])
                if node.op == "get_attr":
                    copy.target = name
                copy.meta.setdefault("nn_module_stack", region.meta.get("nn_module_stack"))
                env[node] = copy
        if autocast:
            _call(graph, _exit_autocast, (context,), region)
        elif not region.args[0]:
            outputs = tuple(_call(graph, torch.ops.aten.detach.default, (out,), region, out) for out in outputs)
    for user in list(region.users):
        if user.target is not operator.getitem:
            raise PipelineTraceError("parallel.pp: a grad-mode or autocast region's result is used whole")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    body_node = region.args[at]
    graph.erase_node(region)
    if not body_node.users:  # the body's attribute node, which outlining would also mistake
        graph.erase_node(body_node)


def _trace_failure(model: nn.Module, failure: Exception, traced: bool) -> str:
    """One paragraph: why tracing (or, once traced, cutting) failed, from the innermost
    cause's first line, and what to do."""
    cause: BaseException = failure
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = str(cause).strip().splitlines()
    why = f"{type(cause).__name__}: {lines[0][:300] if lines else ''}"
    if traced:
        return (f"parallel.pp > 1: {type(model).__name__} was traced, but cutting the trace into pipeline stages "
                f"failed ({why}); train this model without pipeline parallelism (parallel.pp = 1, with fsdp or tp)")
    return (f"parallel.pp > 1 cuts {type(model).__name__} into stages by tracing its forward with torch.export, "
            f"and the trace failed ({why}). Make the forward traceable: no Python branches or loops on tensor "
            "values, no .item() or .tolist(), only tensors and their logits as output; or train this model "
            "without pipeline parallelism (parallel.pp = 1, with fsdp or tp)")


def _check_inputs(pipe: Pipe, model: nn.Module) -> None:
    """Only the first stage may read the model's input: later stages get activations."""
    stages = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    for index, node in enumerate(stages[1:], start=1):
        for arg in node.args:
            while isinstance(arg, fx.Node) and arg.op == "call_function":
                arg = arg.args[0]
            if isinstance(arg, fx.Node) and arg.op == "placeholder":
                raise PipelineTraceError(
                    f"parallel.pp: {type(model).__name__} reads its input tokens again after the first block "
                    f"(in stage {index}); the pipeline passes only activations between stages. Compute what "
                    "needs the tokens before the first block, or train it without pipeline parallelism")


def _chain(pipe: Pipe) -> None:
    """Make every stage receive all it needs from the stage before it: torch's split lets
    a later stage read an earlier stage's output directly (Llama's rotary cos/sin, a
    mask), which the interleaved schedules refuse. Each stage in between then passes such
    values on: it receives them as extra inputs and returns them as extra outputs."""
    root = pipe.split_gm.graph
    calls = [node for node in root.nodes if node.op == "call_module"]
    index_of = {node: index for index, node in enumerate(calls)}

    def producer(value: fx.Node) -> int:
        return index_of[value.args[0] if value.target is operator.getitem else value]

    if all(producer(arg) == index - 1 for index, call in enumerate(calls[1:], 1) for arg in call.args):
        return
    carried: list[list[fx.Node]] = []
    for index in range(len(calls) - 1):
        later = dict.fromkeys(arg for call in calls[index + 1:] for arg in call.args if producer(arg) <= index)
        carried.append(list(later))
    metas = {value: _value_meta(pipe.split_gm, value) for values in carried for value in values}
    for index, call in enumerate(calls):
        stage = pipe.split_gm.get_submodule(str(call.target))
        received = _take_inputs(stage, list(call.args), carried[index - 1], metas) if index else {}
        if index < len(calls) - 1:
            _give_outputs(stage, call, carried[index], received)
    for index, call in enumerate(calls[1:], 1):
        with root.inserting_after(calls[index - 1]):  # created in output order: the order stages send in
            call.args = tuple(root.call_function(operator.getitem, (calls[index - 1], i))
                              for i in range(len(carried[index - 1])))
    for node in list(root.nodes):
        if node.target is operator.getitem and not node.users:
            root.erase_node(node)
    pipe.split_gm.recompile()


def _contiguous_boundaries(pipe: Pipe) -> None:
    """Make what each stage sends contiguous, and what the next one receives shaped so.
    torch allocates a stage's receive buffers with the strides the trace recorded for the
    values, and gloo and NCCL transfer contiguous tensors only: a Hugging Face OPT layer
    returns its hidden states as a transposed view, whose strides no buffer can have."""
    calls = [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]
    for call in calls[:-1]:  # the last stage's logits go to the loss, not to a stage
        stage = pipe.split_gm.get_submodule(str(call.target))
        output = next(node for node in stage.graph.nodes if node.op == "output")
        with stage.graph.inserting_before(output):
            output.args = fx.node.map_arg(output.args, lambda value: _made_contiguous(stage.graph, value))
        stage.recompile()
    for call in calls[1:]:
        stage = pipe.split_gm.get_submodule(str(call.target))
        for node in stage.graph.nodes:
            if node.op == "placeholder" and not _is_contiguous(node):
                node.meta["val"] = _contiguous_like(node.meta["val"])


def _refuse_non_float_boundaries(pipe: Pipe, model: nn.Module) -> None:
    """Refuse a cut whose stages pass a non-floating tensor on (a Hugging Face model's position
    ids or mask), which torch before 2.13 cannot receive (``RECEIVES_NON_FLOAT``): its first
    step would fail on the receiving rank and leave the other waiting."""
    crossing = {}
    for call in [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"][1:]:
        stage = pipe.split_gm.get_submodule(str(call.target))
        for node in stage.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and not value.is_floating_point():
                crossing[node.name.removeprefix("carried_")] = str(value.dtype).removeprefix("torch.")
    if crossing:
        named = ", ".join(f"{name} ({dtype})" for name, dtype in crossing.items())
        raise PipelineTraceError(
            f"parallel.pp: the stages of {type(model).__name__} pass non-floating tensors on ({named}), which "
            f"torch {torch.__version__} cannot send between pipeline stages (torch 2.13 and later can); install "
            "torch 2.13 or later, or train this model without pipeline parallelism (parallel.pp = 1, with fsdp "
            "or tp)")


def _is_contiguous(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.is_contiguous()


def _contiguous_like(value: torch.Tensor) -> torch.Tensor:
    """An example value shaped as ``value``, with contiguous strides."""
    fake_mode = getattr(value, "fake_mode", None)
    if fake_mode is None:
        return value.clone(memory_format=torch.contiguous_format)
    with fake_mode:
        return value.clone(memory_format=torch.contiguous_format)


def _made_contiguous(graph: fx.Graph, value: fx.Node) -> fx.Node:
    """``value``, or a contiguous copy of it where the trace recorded other strides."""
    if _is_contiguous(value):
        return value
    node = graph.call_function(torch.ops.aten.clone.default, (value,),
                               {"memory_format": torch.contiguous_format})
    node.meta = {**value.meta, "val": _contiguous_like(value.meta["val"])}
    return node


def _take_inputs(stage: fx.GraphModule, old: list[fx.Node], wanted: list[fx.Node],
                 metas: dict[fx.Node, object]) -> dict[fx.Node, fx.Node]:
    """Give ``stage`` one input per value in ``wanted`` (root graph values), in order: its
    own inputs where it had them, new ones for values it only passes on. Returns the
    stage's input node for each wanted value."""
    graph = stage.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    by_value = dict(zip(old, placeholders))
    first = next(node for node in graph.nodes if node.op != "placeholder")
    received = {}
    with graph.inserting_before(first):
        for value in wanted:
            node = graph.placeholder(f"carried_{value.name}")
            node.meta = dict(by_value[value].meta) if value in by_value else {"val": metas[value]}
            received[value] = node
    for value, placeholder in by_value.items():
        placeholder.replace_all_uses_with(received[value])
        graph.erase_node(placeholder)
    return received


def _give_outputs(stage: fx.GraphModule, call: fx.Node, wanted: list[fx.Node],
                  received: dict[fx.Node, fx.Node]) -> None:
    """Make ``stage`` (run by ``call``) return exactly ``wanted``: its own outputs, and
    the values it received only to pass them on."""
    output = next(node for node in stage.graph.nodes if node.op == "output")
    own = output.args[0]
    values = []
    for value in wanted:
        if value is call:
            values.append(own)
        elif value.target is operator.getitem and value.args[0] is call:
            values.append(own[value.args[1]])
        else:
            values.append(received[value])
    output.args = (tuple(values),)
    stage.recompile()


def _value_meta(split: fx.GraphModule, value: fx.Node) -> object:
    """The example value of a root graph value: the matching output of its stage's graph."""
    call = value.args[0] if value.target is operator.getitem else value
    stage = split.get_submodule(str(call.target))
    output = next(node for node in stage.graph.nodes if node.op == "output").args[0]
    node = output[value.args[1]] if value.target is operator.getitem else output
    return node.meta.get("val")


def _drop_unused(stage: nn.Module) -> None:
    """Remove tensors no graph of the stage reads. torch's split attaches a weight under
    every name it has in the model, so a tied head's weight also sits on the first stage,
    where it would take memory and appear in checkpoints."""
    used = set()
    for path, module in stage.named_modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, fx.Graph):
            used.update(_join(path, node.target) for node in graph.nodes if node.op == "get_attr")
    named = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
    for name, _ in named:
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            delattr(stage.get_submodule(owner), leaf)
    # Plain modules the split created only to hold such attributes are now empty.
    for path, module in reversed(list(stage.named_modules())):  # children before their parents
        if path and type(module) is nn.Module and not any(True for _ in module.parameters()):
            parent, _, leaf = path.rpartition(".")
            if hasattr(stage.get_submodule(parent), leaf):
                delattr(stage.get_submodule(parent), leaf)


def _restore_persistence(stage: nn.Module, non_persistent: set[str]) -> None:
    """The split registers every buffer as persistent; non-persistent ones of the model
    (a rotary table) stay out of checkpoints, as they are without pipelining."""
    for name, _ in stage.named_buffers():
        if name.removeprefix(PREFIX + ".") in non_persistent:
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


def _retarget_devices(stage: nn.Module, traced_on: torch.device, device: torch.device) -> None:
    """Tensors the forward creates or moves (positions, masks, a rotary table) were traced
    on the example's device (meta for a model built on it): use the stage's device."""
    def retarget(value: object) -> object:
        return device if isinstance(value, torch.device) and value == traced_on else value

    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph) or traced_on == device:
            continue
        for node in graph.nodes:
            node.args = fx.node.map_aggregate(node.args, retarget)
            node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
            if node.target is _enter_autocast and node.args[0] == traced_on.type:
                node.args = (device.type, *node.args[1:])
        _recompile(module)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with the current index on a GPU: a traced graph also asserts tensors'
    devices, and 'cuda' is not 'cuda:0' there."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _recompile(module: nn.Module) -> None:
    if isinstance(module, fx.GraphModule):
        module.recompile()
    elif isinstance(module.__dict__.get("graph_module"), fx.GraphModule):
        module.__dict__["graph_module"].recompile()


def _release_copies(stage: nn.Module) -> None:
    """An outlined module's code-generated twin (``graph_module``) holds its own references
    to the module's tensors, though it reads them from the module: drop them, so that
    tensors which sharding or materializing replace are freed."""
    for module in stage.modules():
        twin = module.__dict__.get("graph_module")
        if isinstance(twin, fx.GraphModule) and twin is not module:
            twin._parameters.clear()
            twin._buffers.clear()


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(name for name, module in parent.named_children() if module is child)


def _join(path: str, name: object) -> str:
    return f"{path}.{name}" if path else str(name)


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")
