"""The TensorFlow backend: ``Collectives`` over TensorFlow's own collective ops (those under
``MultiWorkerMirroredStrategy``: ring all-reduce over gRPC on CPUs, NCCL on GPUs), no Horovod.

Why: Horovod is frozen, TensorFlow's collectives are maintained with TensorFlow. One MPI
exchange gives every rank the others' addresses; TensorFlow's eager context then becomes a
cluster of ``size`` tasks (this must happen before any tensor exists in the process). Every
collective carries a group key and an instance key drawn when it *runs*, so a retrace shifts no
key; ranks must issue collectives in the same order, as with Horovod. No empty tensor reaches
the all-gather (it crashes the process): ``concatenated`` pads. On CPUs no message is over 8
MiB (gRPC copies each one whole: ``tf_messages``). Elastic resizing and Adasum are refused
with one line naming the Horovod backend.
"""

from __future__ import annotations

import atexit
import pickle
import socket
import threading
from typing import Any, Callable, Sequence

from hvdtrain.collectives.base import GradientReduction, tf_variables
from hvdtrain.collectives.tf_graph_mode import SessionNodes, eagerly, in_session_graph
from hvdtrain.collectives.tf_messages import message_batches, on_the_wire, piece_lengths
from hvdtrain.collectives.tf_ordering import OrderingTokens
from hvdtrain.collectives.world import World
from hvdtrain.errors import UserError

JOB = "worker"
# gRPC ports are chosen free and bound a moment later by TensorFlow's server.
CPU_GROUP, GPU_GROUP = 1, 2
# A rank whose process has ended is found by the coordination service's heartbeats within this
# time even when no collective waits on it (a SIGKILLed peer fails a pending collective at once).
HEARTBEAT_TIMEOUT_MS = 30_000


def free_port() -> int:
    """A TCP port free on this host now (a moment later its user binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _reachable_host() -> str:
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return "127.0.0.1"
    return host


def world_from(rank: int, hosts: Sequence[str]) -> World:
    """Rank facts from every rank's host name (in rank order): local ranks share a host; nodes
    are numbered in the order their first rank appears."""
    host = hosts[rank]
    nodes = list(dict.fromkeys(hosts))
    return World(rank, len(hosts), hosts[:rank].count(host), hosts.count(host),
                 nodes.index(host), len(nodes), host)


def _exchange(address: str) -> tuple[int, list[str]]:
    """This rank's number and every rank's ``host:port``, in rank order (one MPI allgather)."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise UserError("--backend tensorflow needs mpi4py to find the other ranks; run "
                        "launch/setup.sh (or pip install mpi4py)") from error
    if not MPI.Is_initialized():   # imported without initialising (``hvdtrain doctor``)
        MPI.Init()

        def finalize() -> None:
            if not MPI.Is_finalized():
                MPI.Finalize()

        atexit.register(finalize)
    comm = MPI.COMM_WORLD
    return comm.Get_rank(), list(comm.allgather(address))


class TensorFlowCollectives:
    """Collectives over TensorFlow's collective ops (see the module doc); one per process."""

    backend = "tensorflow"
    chosen = "as asked"

    def __init__(self, prepare: Callable[[World], Any] = lambda world: None,
                 timeout_s: float = 0.0) -> None:
        """Find the other ranks, call ``prepare(world)`` (device placement: before the
        runtime starts) and start the cluster. ``timeout_s``: a limit on every collective
        (0: none; the run's liveness monitor bounds a stall)."""
        host = _reachable_host()
        rank, addresses = _exchange(f"{host}:{free_port()}")
        self.world = world_from(rank, [address.rsplit(":", 1)[0] for address in addresses])
        prepare(self.world)
        import tensorflow as tf

        self._tf = tf
        self._start_cluster(addresses)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next_keys = {CPU_GROUP: 1, GPU_GROUP: 1}
        self._cpu = f"/job:{JOB}/replica:0/task:{rank}/device:CPU:0"
        gpus = tf.config.get_visible_devices("GPU")
        self._gpu = f"/job:{JOB}/replica:0/task:{rank}/device:GPU:0" if gpus else None
        self._session_nodes = SessionNodes()
        devices = {CPU_GROUP: self._cpu, GPU_GROUP: self._gpu}
        self._tokens = OrderingTokens({group: device for group, device in devices.items()
                                       if device is not None}, ring_group=CPU_GROUP)

    def _start_cluster(self, addresses: list[str]) -> None:
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
        from tensorflow.core.protobuf import tensorflow_server_pb2
        from tensorflow.python.eager import context

        tf, rank = self._tf, self.world.rank
        leader = f"/job:{JOB}/replica:0/task:0"
        ctx = context.context()
        try:
            ctx.configure_collective_ops(collective_leader=leader,
                                         device_filters=(f"/job:{JOB}/task:{rank}",))
        except (RuntimeError, ValueError) as error:
            raise UserError("--backend tensorflow must start before any TensorFlow tensor or "
                            "model exists in the process: call hvdtrain.init() first, or pass "
                            "hvdtrain.fit a function that builds the model") from error
        ctx.configure_coordination_service(
            service_type="standalone", service_leader=leader,
            heartbeat_timeout_in_ms=HEARTBEAT_TIMEOUT_MS,
            coordinated_jobs=[coordination_config_pb2.CoordinatedJob(
                name=JOB, num_tasks=len(addresses))])
        config = ctx.config
        config.experimental.collective_group_leader = leader
        del config.device_filters[:]
        config.device_filters.append(f"/job:{JOB}/task:{rank}")
        server = tensorflow_server_pb2.ServerDef(
            cluster=tf.train.ClusterSpec({JOB: addresses}).as_cluster_def(),
            default_session_config=config, job_name=JOB, task_index=rank, protocol="grpc",
            port=int(addresses[rank].rsplit(":", 1)[1]))
        ctx.enable_collective_ops(server)
        ctx.ensure_initialized()

    # --- keys and the raw operations --------------------------------------------------------

    def _instance_key(self, group: int) -> Any:
        """The group's next instance key, drawn when the operation runs (see the module doc)."""
        from tensorflow.python.eager import context
        from tensorflow.python.framework import ops

        tf = self._tf
        graph = ops.get_default_graph()
        while getattr(graph, "is_control_flow_graph", False):
            graph = graph.outer_graph
        if not context.executing_eagerly() and graph.building_function:
            with graph.as_default():
                return graph.capture_call_time_value(lambda: self._instance_key(group),
                                                     tf.TensorSpec([], tf.int32))
        with self._lock:
            key = self._next_keys[group]
            self._next_keys[group] = key + 1
        with tf.device("CPU:0"):
            return tf.constant(key, tf.int32)

    def _group_of(self, tensor: Any) -> tuple[int, str, str]:
        """(group, device, communication hint) for a tensor: NCCL for one on a GPU."""
        if self._gpu is not None and "GPU" in (getattr(tensor, "device", "") or "").upper():
            return GPU_GROUP, self._gpu, "nccl"
        return CPU_GROUP, self._cpu, "ring"

    def _collective(self, run: Callable[..., Any], value: Any, shape: Any,
                    gathered: bool = False) -> Any:
        """``run(value, group_key, instance_key, ordering_token, communication_hint)`` on
        ``value``, whole or, on the CPU ring when its size is known and over ``MESSAGE_BYTES``,
        on each of its flattened pieces in turn (the same on every rank: shapes agree), joined
        again. ``shape``: the result's; ``gathered``: the result is every rank's ``value``
        stacked (so each piece comes back as every rank's piece, in rank order)."""
        tf = self._tf
        elements = value.shape.num_elements()
        lengths = ([] if elements is None or self._group_of(value)[0] == GPU_GROUP else
                   piece_lengths(elements, value.dtype.size))
        if len(lengths) <= 1:
            return self._message(run, value, shape)
        size = self.world.size if gathered else 1
        results = [tf.reshape(self._message(run, piece, [size * length]), [size, length])
                   for piece, length in zip(tf.split(tf.reshape(value, [-1]), lengths), lengths)]
        return tf.reshape(tf.concat(results, 1), shape)

    def _message(self, run: Callable[..., Any], value: Any, shape: Any) -> Any:
        """One collective op (``_collective``'s ``run``) with the group's next key, on this
        rank's device, eagerly or in a tf.function; in a TensorFlow 1 graph, a node that runs it
        eagerly whenever the session runs the node (``tf_graph_mode``: on the CPU ring, no
        token)."""
        tf = self._tf
        if in_session_graph():
            def on_the_cpu(eager_value: Any, group: int, key: int) -> Any:
                with tf.device(self._cpu):
                    return run(eager_value, group, key, None, "ring")

            return self._session_nodes.node(on_the_cpu, value, shape)
        group, device, hint = self._group_of(value)
        with tf.device(device):
            return run(value, group, self._instance_key(group), self._tokens.token(group), hint)

    def all_reduce(self, tensor: Any, merge_op: str = "Add") -> Any:
        """``tensor`` combined across ranks by ``merge_op`` ("Add", "Mul", "Min", "Max")."""
        from tensorflow.python.ops import collective_ops

        def reduce(value: Any, group: int, key: Any, token: Any, hint: str) -> Any:
            return collective_ops.all_reduce_v2(
                value, self.world.size, group, key, merge_op=merge_op, final_op="Id",
                communication_hint=hint, timeout=self.timeout_s, ordering_token=token)

        return self._collective(reduce, tensor, tensor.shape)

    def all_gather(self, tensor: Any) -> Any:
        """Every rank's ``tensor`` (the same shape on every rank) concatenated along the first
        dimension. Never with zero elements: TensorFlow's all-gather then crashes the process
        (a segmentation fault, measured), so callers pad (``concatenated``)."""
        from tensorflow.python.ops import collective_ops

        def gather(value: Any, group: int, key: Any, token: Any, hint: str) -> Any:
            return collective_ops.all_gather_v2(
                value, self.world.size, group, key, communication_hint=hint,
                timeout=self.timeout_s, ordering_token=token)

        first = tensor.shape[0] if tensor.shape.rank else None
        shape = self._tf.TensorShape([None if first is None else first * self.world.size]
                                     ).concatenate(tensor.shape[1:])
        return self._collective(gather, tensor, shape, gathered=True)

    def broadcast_tensor(self, tensor: Any, root_rank: int) -> Any:
        """The root rank's ``tensor`` on every rank (each rank passes a tensor of the root's
        shape and dtype: the receivers' values are not used)."""
        from tensorflow.python.ops import collective_ops

        tf, size = self._tf, self.world.size

        def broadcast(value: Any, group: int, key: Any, token: Any, hint: str) -> Any:
            if self.world.rank == root_rank:
                return collective_ops.broadcast_send_v2(
                    value, size, group, key, communication_hint=hint, timeout=self.timeout_s)
            return collective_ops.broadcast_recv_v2(
                tf.shape(value), value.dtype, size, group, key, communication_hint=hint,
                timeout=self.timeout_s)

        return self._collective(broadcast, tensor, tensor.shape)

    # --- the Collectives protocol ----------------------------------------------------------

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Sum each tensor across ranks: one all-reduce per batch of the flattened tensors
        (``message_batches``; graph-safe)."""
        tf = self._tf
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        reduced: list[Any] = [None] * len(tensors)
        for indices in message_batches(tensors, self._gpu is None):
            flats = [tf.reshape(tensors[i], [-1]) for i in indices]
            total = self.all_reduce(flats[0] if len(flats) == 1 else tf.concat(flats, 0))
            parts = (tf.split(total, [tf.size(tensors[i]) for i in indices])
                     if len(indices) > 1 else [total])
            for index, part in zip(indices, parts):
                reduced[index] = tf.reshape(part, tf.shape(tensors[index]))
        return reduced

    def reduce_scatter_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """TensorFlow's reduce-scatter has an implementation for NCCL alone, so this is the
        all-reduce of the tensors (``allreduce_sum``) with each rank keeping its piece: twice a
        reduce-scatter's bytes on the wire."""
        tf, size, rank = self._tf, self.world.size, self.world.rank
        totals = self.allreduce_sum(tensors)
        return [tf.reshape(total, [size, -1])[rank] for total in totals]

    def allgather(self, tensors: Sequence[Any]) -> list[Any]:
        """One all-gather per batch of the tensors concatenated (``message_batches``)."""
        tf = self._tf
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        gathered: list[Any] = [None] * len(tensors)
        for indices in message_batches(tensors, self._gpu is None):
            if len(indices) == 1:    # as it is: no copy into a concatenation
                gathered[indices[0]] = self.all_gather(tensors[indices[0]])
                continue
            lengths = [tf.size(tensors[i]) for i in indices]
            rows = tf.reshape(self.all_gather(tf.concat([tensors[i] for i in indices], 0)),
                              [self.world.size, -1])
            for index, part in zip(indices, tf.split(rows, lengths, axis=1)):
                gathered[index] = tf.reshape(part, [-1])
        return gathered

    def reduce_gradients(self, tensors: Sequence[Any],
                         reduction: GradientReduction = GradientReduction()) -> list[Any]:
        """Dense gradients summed in one all-reduce per dtype and bucket (fp16 or bf16 on the
        wire: cast around the sum, which TensorFlow's collective adds in the wire's type, one
        rounding per addition), averaged over the world for "average", pre- and post-scaled; a
        sparse one's rows gathered from every rank (as Horovod gives them); None stays None.
        On the CPU ring each bucket's all-reduce runs as soon as its gradients exist, beside
        the others (``tf_ordering``), or after the one issued before (``in_issue_order``)."""
        tf = self._tf
        if reduction.op == "adasum":
            raise UserError("Adasum needs the Horovod backend; use --backend horovod or "
                            "--reduction mean")
        reduced = list(tensors)
        dense, sparse = [], []
        for index, tensor in enumerate(tensors):
            if isinstance(tensor, tf.IndexedSlices) and reduction.sparse_as_dense:
                reduced[index] = tensor = tf.convert_to_tensor(tensor)
            if isinstance(tensor, tf.IndexedSlices):
                sparse.append(index)
            elif tensor is not None:
                dense.append(index)
        scale = reduction.postscale / (self.world.size if reduction.op == "average" else 1)
        wire = [reduced[i] * reduction.prescale if reduction.prescale != 1.0 else reduced[i]
                for i in dense]
        wire = [reduction.on_wire(t) for t in wire]
        with self._tokens.each_its_own():
            previous: list[Any] = []
            for bucket in reduction.buckets([reduced[i] for i in dense]):
                previous = self.allreduce_sum(reduction.submitted(previous,
                                                                  [wire[i] for i in bucket]))
                for index, total in zip((dense[i] for i in bucket), previous):
                    total = tf.cast(total, reduced[index].dtype)
                    reduced[index] = total * scale if scale != 1.0 else total
            # After the buckets: with a GPU every collective runs in program order, and a
            # sparse gradient (an embedding's, usually the first layer's) exists only at the
            # backward pass's end; gathered first, it would hold every bucket back.
            for index in sparse:
                reduced[index] = self._gathered_rows(reduced[index], reduction)
        return reduced

    def _gathered_rows(self, slices: Any, reduction: GradientReduction) -> Any:
        """Every rank's rows of a sparse gradient, in rank order (ranks may hold different
        numbers of rows)."""
        tf = self._tf
        counts = self.all_gather(tf.shape(slices.indices, out_type=tf.int64)[:1])
        values = self.concatenated(slices.values, counts)
        indices = self.concatenated(tf.cast(slices.indices, tf.int64), counts)
        scale = reduction.prescale * reduction.postscale / (
            self.world.size if reduction.op == "average" else 1)
        return tf.IndexedSlices(values * scale if scale != 1.0 else values,
                                tf.cast(indices, slices.indices.dtype), slices.dense_shape)

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> Any:
        """Overwrite every rank's variables with the root rank's: one broadcast per batch of
        the flattened values (``message_batches``; eagerly, in a tf.function, or in a
        TensorFlow 1 graph, where the assignments are returned as one op to run)."""
        tf = self._tf
        variables = tf_variables(variables)
        assignments = []
        for batch in message_batches(variables, self._gpu is None):
            group = [variables[i] for i in batch]
            sizes = [int(variable.shape.num_elements()) for variable in group]
            flats = [tf.reshape(variable, [-1]) for variable in group]
            received = self.broadcast_tensor(flats[0] if len(flats) == 1 else
                                             tf.concat(flats, 0), root_rank)
            # The root assigns too: in a tf.function an unused broadcast send is pruned, and
            # the receivers would wait for ever.
            for variable, part in zip(group, tf.split(received, sizes)):
                assignments.append(variable.assign(tf.reshape(part, variable.shape)))
        return tf.group(*assignments) if in_session_graph() else None

    @staticmethod
    def _as_words(data: bytes, words: int) -> Any:
        """Bytes as int32 words (collectives carry no uint8), zero-padded."""
        import numpy as np

        buffer = np.zeros(words * 4, np.uint8)
        buffer[:len(data)] = np.frombuffer(data, np.uint8)
        return buffer.view(np.int32)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order (lengths first, then the payloads padded
        to the longest); exchanged at once, also when called inside a graph."""
        tf = self._tf
        data = pickle.dumps(obj)
        with eagerly():
            lengths = self.all_gather(tf.constant([len(data)], tf.int64)).numpy()
            words = (int(lengths.max()) + 3) // 4
            gathered = self.all_gather(tf.constant(self._as_words(data, words))).numpy()
        raw = gathered.reshape(self.world.size, words).view("uint8")
        return [pickle.loads(raw[rank, :lengths[rank]].tobytes())
                for rank in range(self.world.size)]

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """The root rank's picklable object on every rank; exchanged at once, also when called
        inside a graph."""
        tf = self._tf
        data = pickle.dumps(obj) if self.world.rank == root_rank else b""
        with eagerly():
            length = int(self.broadcast_tensor(tf.constant([len(data)], tf.int64),
                                               root_rank).numpy()[0])
            words = (length + 3) // 4
            received = self.broadcast_tensor(tf.constant(self._as_words(data, words)), root_rank)
        if self.world.rank == root_rank:
            return obj
        return pickle.loads(received.numpy().view("uint8")[:length].tobytes())

    def shutdown(self) -> None:
        """Tell every rank's collectives that this rank failed: their pending and next
        collectives end at once with an error (through the coordination service)."""
        from tensorflow.python.eager import context

        try:
            context.context().report_error_to_cluster(
                self._tf.errors.ABORTED, f"hvdtrain: rank {self.world.rank} ended with an error")
        except Exception:  # noqa: BLE001 - the cluster may be gone already; nothing to tell
            pass

    def concatenated(self, tensor: Any, firsts: Any) -> Any:
        """Every rank's ``tensor`` (``firsts``: each rank's first dimension) in rank order.
        Each rank sends its rows padded to the most any rank has, flattened, plus one element:
        TensorFlow's all-gather crashes on an empty tensor, and every rank may have none (or
        rows of no elements)."""
        tf = self._tf
        wire, dtype = on_the_wire(tensor)
        known = tf.get_static_value(firsts)
        if known is not None and known.min() == known.max() and tensor.shape.num_elements():
            # Eagerly, or in a graph whose every rank's shape was known when it was built (then
            # the other dimensions, agreed, are known too): equal non-empty parts travel as
            # they are.
            return tf.cast(self.all_gather(wire), dtype)
        shape = tf.shape(wire, out_type=tf.int64)
        slots = tf.reduce_max(firsts)
        sent = tf.pad(tf.reshape(wire, [-1]),
                      [[0, (slots - shape[0]) * tf.reduce_prod(shape[1:]) + 1]])
        gathered = tf.reshape(self.all_gather(sent), [self.world.size, -1])[:, :-1]
        rows = tf.reshape(gathered, tf.concat([[self.world.size, slots], shape[1:]], 0))
        every = tf.cast(tf.boolean_mask(rows, tf.sequence_mask(firsts, slots)), dtype)
        every.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return every


_SESSION: TensorFlowCollectives | None = None


def tensorflow_collectives(prepare: Callable[[World], Any] = lambda world: None
                           ) -> TensorFlowCollectives:
    """This process's TensorFlow-backend collectives: a cluster starts once per process, so a
    second run in it (a notebook, a test) reuses it (``prepare`` then finds the devices
    placed)."""
    global _SESSION
    if _SESSION is None:
        _SESSION = TensorFlowCollectives(prepare)
    else:
        prepare(_SESSION.world)
    return _SESSION
