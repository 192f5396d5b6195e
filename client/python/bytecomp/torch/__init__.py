"""PyTorch integration, shaped like Horovod's and BytePS's APIs.

    import bytecomp.torch as bc
    bc.init()                                   # reads RANK, WORLD_SIZE, ... (bytecomp.env)
    model = Net()
    bc.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * bc.size())
    opt = bc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  strategy="configs/demo-strategy.yaml")
    bc.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()         # each gradient is pushed when ready
        opt.step()                              # waits for the rest, averages, steps

How it maps onto the thin client (docs/torch.md):
- `init()` joins a small *control job* ("<job>.ctl") with one scratch
  tensor (float64 on one node; float32 across nodes, the only dtype the
  parameter servers sum) and two broadcast tensors. allreduce() and the
  agreement checks run through it as sums, exact in the input's dtype
  (integers as 16-bit digits, float64 across nodes gathered and summed
  locally); broadcasts copy raw bytes (the daemons' broadcast), so every
  dtype arrives bit for bit. Every control-job call runs on one worker
  thread in call order, so the *_async forms overlap the caller's work.
- Each `DistributedOptimizer` joins its own job ("<job>.opt0", ".opt1", ...)
  declaring every parameter's gradient in parameter order (first declared =
  first needed by the next forward pass = highest priority). Gradients live
  in that job's shared memory: `param.grad` *is* the buffer the daemon reads
  and writes, so autograd accumulates into it and nothing is copied.
- A hook on each parameter's gradient accumulator pushes the gradient as soon
  as backward has produced it; `step()` pushes what backward did not touch,
  waits for everything (bounded by BYTECOMP_TIMEOUT_MS) and divides by size().

Thread-safety: the module-level API is meant for the training thread. Hooks
run on autograd's thread (the caller's thread for CPU tensors).
"""

# The implementation is split by job (the names below are the public API):
#   _control.py    the control job: init/shutdown, rank/size, barrier, the
#                  process's context and the exact sums the others run through
#   _broadcast.py  broadcasts (tensors, objects, optimizer state)
#   _collectives.py Horovod's allreduce/allgather/broadcast (+ _ and _async
#                  forms, handles, autograd), Average/Sum, Compression
#   _optimizer.py  DistributedOptimizer

from bytecomp._lib import BytecompError
from bytecomp.torch import _control
from bytecomp.torch._broadcast import (broadcast_object, broadcast_optimizer_state,
                                       broadcast_parameters)
from bytecomp.torch._collectives import (Adasum, Average, Compression, Compressor, Sum,
                                         allgather, allgather_async, allreduce, allreduce_,
                                         allreduce_async, allreduce_async_, broadcast, broadcast_,
                                         broadcast_async, broadcast_async_, global_process_set,
                                         poll, synchronize)
# _SCRATCH_ELEMENTS: tests size their tensors by it (bytecomp.torch._SCRATCH_ELEMENTS).
from bytecomp.torch._control import (_SCRATCH_ELEMENTS, MismatchError,  # noqa: F401
                                     NotInitializedError, barrier, init, is_initialized,
                                     local_rank, local_size, node_rank, num_nodes, rank,
                                     shutdown, size)
from bytecomp.torch._optimizer import DistributedOptimizer

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "node_rank", "num_nodes", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "allgather", "allgather_async", "synchronize", "poll", "barrier",
    "Average", "Sum", "Adasum", "Compression", "Compressor", "global_process_set",
    "MismatchError", "NotInitializedError", "BytecompError",
]


def __getattr__(name):
    # The context is rebound by init() and shutdown() in _control; reading it
    # through the package (the bench-torch worker does) must see the current one.
    if name == "_ctx":
        return _control._ctx
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
