"""The opt-in int8 mode (docs/decisions/int8-mode.md): the model's MatMuls on int8 activations.

The packaged model stores each weight matrix W (K x N) as an INT8 initializer `q` with a float
per-column scale `s`, rebuilt as `Mul(Cast(q, to=FLOAT), s)` before a float MatMul.
`quantize_activations` hands `q` and `s` as they are to com.microsoft `DynamicQuantizeMatMul`,
which quantises the activations to uint8 at every run (one scale per tensor) and multiplies in
integers, the MatMul's bias Add folded in (without VNNI the weights go shifted into uint8:
int8_support.py).

One scale per tensor is coarse for BERT models: a few input channels reach 5 to 10 times the
range of the rest (scores moved by up to 0.016). Those listed per MatMul in
`assets/int8_float_channels.json` (made by `scripts/calibrate_int8.py`) are zeroed before the
int8 product and multiplied in float32 instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from app.embedding.int8_support import Int8Weights

if TYPE_CHECKING:
    import onnx

MS_DOMAIN: Final = "com.microsoft"
FLOAT_CHANNELS_ASSET: Final = "int8_float_channels.json"


def int8_activation_model(model: bytes, weights: Int8Weights = "int8") -> bytes:
    """The model rewritten for int8 activations, or ValueError when it is not the one whose
    outlier channels are known (the packaged model)."""
    sha256 = hashlib.sha256(model).hexdigest()
    table = float_channel_table()
    if table["model_sha256"] != sha256:
        raise ValueError(
            f"KP_EMBEDDER_PRECISION=int8 is calibrated for the packaged model only "
            f"(sha256 {table['model_sha256'][:16]}...); this model has sha256 {sha256[:16]}... "
            "Use KP_EMBEDDER_PRECISION=float32 with other models."
        )
    return quantize_activations(model, table["float_channels"], weights)


def float_channel_table() -> dict[str, Any]:
    """The asset: the model's sha256 and, per MatMul node name, the channels kept in float32."""
    text = (resources.files("app.embedding") / "assets" / FLOAT_CHANNELS_ASSET).read_text()
    table: dict[str, Any] = json.loads(text)
    return table


def weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMuls `quantize_activations` replaces (B an int8 weight), in graph order."""
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {t.name: t for t in model.graph.initializer}
    return [
        node
        for node in model.graph.node
        if node.op_type == "MatMul" and _int8_weight(node, producers, initializers) is not None
    ]


#: A MatMul's B = Mul(Cast(q), scale): q (INT8, K x N) and the scale as DynamicQuantizeMatMul
#: wants it (float, () or (N,)).
_Weight = tuple["onnx.TensorProto", "onnx.TensorProto"]


def quantize_activations(
    model: bytes, float_channels: Mapping[str, Sequence[int]], weights: Int8Weights
) -> bytes:
    """The model with each int8-weight MatMul computed by DynamicQuantizeMatMul (MatMuls of two
    activations, as attention's, and anything else off the pattern are left as they are);
    `float_channels` maps a MatMul node name to input channels kept in float32, `weights` is
    the type DynamicQuantizeMatMul gets them in."""
    import onnx  # only int8 mode needs it, and it is slow to import
    from onnx import helper

    proto = onnx.load_from_string(model)
    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    nodes: list[onnx.NodeProto] = []
    new: dict[str, onnx.TensorProto] = {}  # initializers to add, by name (shared ones once)
    done: set[str] = set()  # outputs already produced (a mask shared by Q, K and V)
    fused: set[int] = set()  # ids of bias Adds folded into the node before them
    for node in graph.node:
        if id(node) in fused:
            continue
        weight = _int8_weight(node, producers, initializers) if node.op_type == "MatMul" else None
        if weight is None:
            nodes.append(node)
            continue
        bias_add = _bias_add(node, consumers, initializers, n=weight[0].dims[1])
        if bias_add is not None:
            fused.add(id(bias_add))
        channels = list(float_channels.get(node.name, ()))
        replacement, tensors = _replacement(node, weight, bias_add, channels, weights)
        nodes += [n for n in replacement if not done.issuperset(n.output)]
        done.update(o for n in replacement for o in n.output)
        new.update((t.name, t) for t in tensors)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new.values())
    _remove_unused(graph)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    out: bytes = proto.SerializeToString()
    return out


def _replacement(
    matmul: onnx.NodeProto,
    weight: _Weight,
    bias_add: onnx.NodeProto | None,
    channels: list[int],
    weights: Int8Weights,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes and new initializers computing MatMul (+ bias) with int8 activations."""
    from onnx import helper, numpy_helper

    a = matmul.input[0]
    out = (bias_add or matmul).output[0]
    b, weight_scale = weight
    q = numpy_helper.to_array(b)
    zero_point = np.zeros(tuple(weight_scale.dims), dtype=np.int8)
    tensors = [weight_scale]
    if weights == "uint8":  # (q + 128) - 128 = q - 0: the same products, exact without VNNI
        b = numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8), f"{b.name}_u8")
        zero_point = np.full_like(zero_point, 128, dtype=np.uint8)
        tensors.append(b)
    zp = numpy_helper.from_array(zero_point, f"{weight_scale.name}_zero_point")
    tensors.append(zp)
    bias = [] if bias_add is None else [i for i in bias_add.input if i != matmul.output[0]]
    if not channels:
        return [_dqmm(matmul.name, a, b, weight_scale, zp, bias, out)], tensors

    # Y = DQMM(A * mask) + Gather(A, channels) @ (q[channels] * scale)
    scale = numpy_helper.to_array(weight_scale)
    mask = np.ones(q.shape[0], dtype=np.float32)
    mask[channels] = 0
    key = f"{a}_c{'_'.join(map(str, channels))}"  # the same for Q, K and V: built once
    p = matmul.name
    tensors += [
        numpy_helper.from_array(mask, f"{key}_mask"),
        numpy_helper.from_array(np.asarray(channels, dtype=np.int64), f"{key}_index"),
        numpy_helper.from_array(q[channels].astype(np.float32) * scale, f"{p}_rows"),
    ]
    nodes = [
        helper.make_node("Mul", [a, f"{key}_mask"], [f"{key}_rest"], name=f"{key}_rest"),
        helper.make_node(
            "Gather", [a, f"{key}_index"], [f"{key}_outliers"], axis=-1, name=f"{key}_outliers"
        ),
        _dqmm(p, f"{key}_rest", b, weight_scale, zp, bias, f"{p}_int8"),
        helper.make_node(
            "MatMul", [f"{key}_outliers", f"{p}_rows"], [f"{p}_float"], name=f"{p}_float"
        ),
        helper.make_node("Add", [f"{p}_int8", f"{p}_float"], [out], name=f"{p}_sum"),
    ]
    return nodes, tensors


def _dqmm(
    name: str,
    a: str,
    b: onnx.TensorProto,
    scale: onnx.TensorProto,
    zero_point: onnx.TensorProto,
    bias: list[str],
    out: str,
) -> onnx.NodeProto:
    from onnx import helper

    inputs = [a, b.name, scale.name, zero_point.name, *bias]
    return helper.make_node(
        "DynamicQuantizeMatMul", inputs, [out], name=f"{name}_int8", domain=MS_DOMAIN
    )


def _int8_weight(
    matmul: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    initializers: dict[str, onnx.TensorProto],
) -> _Weight | None:
    """B's int8 matrix and scale when B = Mul(Cast(int8 K x N), per-tensor/per-column scale)."""
    import onnx
    from onnx import numpy_helper

    mul = producers.get(matmul.input[1])
    if mul is None or mul.op_type != "Mul":
        return None
    for cast_out, scale_name in (mul.input, mul.input[::-1]):
        cast = producers.get(cast_out)
        scale = initializers.get(scale_name)
        if cast is None or cast.op_type != "Cast" or scale is None:
            continue
        q = initializers.get(cast.input[0])
        to = next((a.i for a in cast.attribute if a.name == "to"), None)
        if (
            q is None
            or q.data_type != onnx.TensorProto.INT8
            or len(q.dims) != 2
            or to != onnx.TensorProto.FLOAT
            or scale.data_type != onnx.TensorProto.FLOAT
        ):
            continue
        # A scalar, or an (N,) vector: (1, N) broadcasts along the columns of K x N.
        values, n = numpy_helper.to_array(scale), q.dims[1]
        if values.size != 1 and values.shape not in ((n,), (1, n)):
            return None  # per-row (K, 1) or another layout: keep the float32 path
        columns = values.reshape(() if values.size == 1 else n).astype(np.float32)
        return q, numpy_helper.from_array(columns, f"{scale_name}_per_column")
    return None


def _bias_add(
    matmul: onnx.NodeProto,
    consumers: dict[str, list[onnx.NodeProto]],
    initializers: dict[str, onnx.TensorProto],
    n: int,
) -> onnx.NodeProto | None:
    """The Add of a float (N,) initializer that alone reads the MatMul's output, if any."""
    import onnx

    readers = consumers.get(matmul.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    others = [initializers.get(i) for i in add.input if i != matmul.output[0]]
    if len(others) != 1 or others[0] is None:
        return None
    bias = others[0]
    return add if bias.data_type == onnx.TensorProto.FLOAT and list(bias.dims) == [n] else None


def _remove_unused(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nobody reads, then initializers and value_info nobody reads (the
    packaged model has no subgraphs)."""
    while True:
        used = {o.name for o in graph.output} | {i for n in graph.node for i in n.input}
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for field, names in ((graph.initializer, used), (graph.value_info, produced)):
        kept = [t for t in field if t.name in names]
        del field[:]
        field.extend(kept)
