"""bytecomp.torch's DistributedOptimizer: one job per optimizer whose
gradients live in shared memory and are pushed from autograd hooks.
Internal: use it through bytecomp.torch."""

import contextlib
import os
import time
import warnings

import torch
import yaml

from bytecomp import _lib
from bytecomp._lib import BytecompError, StateError
from bytecomp import gpu as _gpu
from bytecomp import strategy as _strategy
from bytecomp.torch._collectives import (Average, Compression, Compressor, Sum,
                                         _check_process_set, global_process_set)
from bytecomp.torch._control import (_ELEMENT_BYTES, _TORCH_TO_C, NotInitializedError,
                                     _ctx_or_raise, _shm_tensor, _wait)
from bytecomp.torch import _intra
from bytecomp.torch import _staging


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by DistributedOptimizer()."""

    def __init__(self, params, named_parameters, strategy, backward_passes_per_step, op,
                 original, compressors=None, exclude=None, predivide=1.0, overlap_forward=None):
        super(self.__class__, self).__init__(params)
        if original.state:
            self.load_state_dict(original.state_dict())
        c = _ctx_or_raise("DistributedOptimizer")
        if op not in (Average, Sum):
            raise ValueError("DistributedOptimizer: op=%r; use bytecomp.torch.Average or "
                             "bytecomp.torch.Sum" % (op,))
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("DistributedOptimizer: backward_passes_per_step=%r must be an "
                             "integer >= 1" % (backward_passes_per_step,))
        if predivide != 1.0 and op != Average:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor=%r goes with "
                             "op=Average (op is %r)" % (predivide, op))
        if not predivide > 0:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor=%r must be > 0" %
                             (predivide,))
        self._bc_ctx = c
        self._bc_op = op
        self._bc_predivide = float(predivide)
        self._bc_skip_sync = False
        self._bc_passes = backward_passes_per_step
        self._bc_timeout_ms = c.settings.timeout_ms
        self._bc_params = self._bytecomp_names(named_parameters)
        # None: whatever the daemons run (BYTECOMP_STRATEGY says what that is).
        if strategy == "auto":
            self._bc_strategy = _strategy.auto(compressors, exclude)
        elif compressors is not None or exclude is not None:
            raise ValueError("DistributedOptimizer: compressors= and exclude= go with "
                             "strategy='auto' (strategy is %r)" % (strategy,))
        else:
            self._bc_strategy = _strategy.load(strategy)
        self._bc_client = None
        self._bc_iteration = 0
        self._bc_synced = False  # synchronize() done, step() not yet
        self._bc_failed = None
        self._bc_loss_off = False  # the daemon said the job is not auto
        self._bc_loss_warned = False
        # overlap_forward: the model whose forward pre-hooks apply the updates
        # step() left pending (_bc_pending of them); None: step() waits.
        self._bc_overlap = overlap_forward
        self._bc_pending = 0
        self._bc_module_hooks = []
        if overlap_forward is not None:
            self._bytecomp_check_overlap(overlap_forward)
        index = c.next_optimizer
        c.next_optimizer += 1
        self._bc_job = "%s.opt%d" % (c.settings.job_id, index)
        self._bytecomp_start()
        c.optimizers.append(self)
        if overlap_forward is not None:
            self._bytecomp_overlap_hooks(overlap_forward)

    # -- setup -------------------------------------------------------------
    def _bytecomp_names(self, named_parameters):
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            for i, item in enumerate(named):
                if not (isinstance(item, (tuple, list)) and len(item) == 2 and
                        isinstance(item[1], torch.Tensor)):
                    raise TypeError("DistributedOptimizer: named_parameters must yield (name, "
                                    "parameter) pairs, e.g. model.named_parameters(); item %d "
                                    "is %r" % (i, type(item).__name__))
            names = [n for n, _ in named]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError("DistributedOptimizer: named_parameters has duplicate names %s"
                                 % ", ".join(repr(d) for d in dup))
            name_of = {}
            for n, p in named:
                name_of.setdefault(id(p), n)  # tied weights: the first name wins
            missing = [i for i, p in enumerate(in_groups) if id(p) not in name_of]
            if missing:
                raise ValueError(
                    "DistributedOptimizer: %d of the optimizer's parameters are not in "
                    "named_parameters (the first has shape %s): pass the named_parameters "
                    "of the model whose parameters the optimizer updates" %
                    (len(missing), tuple(in_groups[missing[0]].shape)))
        else:
            name_of = {}
            k = 0
            for p in in_groups:
                if id(p) not in name_of:
                    name_of[id(p)] = "param.%d" % k
                    k += 1
        # Forward order is parameter order for nn.Modules; declare that way
        # so the daemon serves the tensors needed first with priority.
        out, seen, cuda_device = [], set(), None
        for p in in_groups:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if p.device.type == "cuda":
                # Staged through pinned shared memory (_staging.py): one
                # device per process, as every launcher places ranks.
                if cuda_device is None:
                    cuda_device = p.device
                elif p.device != cuda_device:
                    raise _lib.UnsupportedError(
                        "BYTECOMP_ERR_UNSUPPORTED",
                        "DistributedOptimizer: parameter %r is on %s and another on %s: one "
                        "CUDA device per process (set CUDA_VISIBLE_DEVICES or "
                        "torch.cuda.set_device(LOCAL_RANK))" %
                        (name_of[id(p)], p.device, cuda_device))
            elif p.device.type != "cpu":
                raise _lib.UnsupportedError(
                    "BYTECOMP_ERR_UNSUPPORTED",
                    "DistributedOptimizer: parameter %r is on %s; supported are CPU and CUDA "
                    "tensors" % (name_of[id(p)], p.device))
            if p.dtype not in _TORCH_TO_C:
                raise TypeError("DistributedOptimizer: parameter %r has dtype %s; supported: "
                                "float32, float64, int32, int64" % (name_of[id(p)], p.dtype))
            if p.is_sparse or not p.is_contiguous():
                raise ValueError("DistributedOptimizer: parameter %r must be dense and "
                                 "contiguous" % (name_of[id(p)],))
            out.append((name_of[id(p)], p))
        if not out:
            raise ValueError("DistributedOptimizer: the optimizer has no parameter that "
                             "requires a gradient")
        self._bc_cuda_device = cuda_device
        return out

    def _bytecomp_start(self):
        c = self._bc_ctx
        s = c.settings
        # With the intra-node shard flow (BYTECOMP_INTRA_NODE, _intra.py) the
        # local ranks sum among themselves first and this process's job is
        # its shard's: one member per node, each tensor cut to the shard.
        self._bc_intra = _intra.IntraNode(_intra.mode(), s, self._bc_job, self._bc_params,
                                          self._bc_cuda_device)
        sharded = self._bc_intra.flow is not None
        self._bc_daemon_job = _gpu.shard_job(self._bc_job, s.local_rank) if sharded else \
            self._bc_job
        try:
            if sharded:
                client = _lib.Client(_gpu.shard_job(self._bc_job, s.local_rank), 0, 1,
                                     s.node_rank, s.num_nodes, s.socket_path,
                                     connect_timeout_ms=min(s.timeout_ms, 60000))
            else:
                client = _lib.Client(self._bc_job, s.local_rank, s.local_size, s.node_rank,
                                     s.num_nodes, s.socket_path,
                                     connect_timeout_ms=min(s.timeout_ms, 60000))
        except BaseException:
            self._bc_intra.close()
            raise
        try:
            ids = []
            counts = [self._bc_intra.shard_count(p.numel()) for _, p in self._bc_params]
            for (name, p), n in zip(self._bc_params, counts):
                ids.append(client.declare(name, n, _TORCH_TO_C[p.dtype]))
            if self._bc_strategy is not None:
                _strategy.check(self._bc_strategy,
                                [(name, n * _ELEMENT_BYTES[p.dtype])
                                 for (name, p), n in zip(self._bc_params, counts)])
                _strategy.apply(self._bc_strategy, client, s.strategy)
            client.start(s.start_timeout_ms)
            self._bc_slots = []
            self._bc_staging = None
            self._bc_pinned = None
            staged = []
            for tid, (name, p), n in zip(ids, self._bc_params, counts):
                addr, nbytes = client.buffer(tid)
                buf = _shm_tensor(addr, nbytes, p.dtype, (n,) if sharded else p.shape)
                slot = _Slot(name, p, tid, buf)
                if p.device.type == "cuda":
                    # The gradient stays on the device; buf is its staging.
                    staged.append((addr, nbytes))
                elif sharded:
                    pass  # host stand-in: staged (HostOps), the gradient stays put
                else:
                    with torch.no_grad():
                        if p.grad is not None:
                            buf.copy_(p.grad)
                        else:
                            buf.zero_()
                    p.grad = buf
                self._bc_slots.append(slot)
            if staged or sharded:
                if staged:
                    self._bc_pinned = _staging.register_host_range(staged)
                by_tid = {sl.tid: sl for sl in self._bc_slots}
                self._bc_staging = _staging.StagingPipeline(
                    self._bc_intra.ops if sharded else
                    _staging.TorchCudaOps(self._bc_cuda_device),
                    lambda tid: self._bc_client.push_pull(tid, self._bc_iteration),
                    lambda tid, h: _wait(self._bc_client, h, self._bc_timeout_ms,
                                         "push_pull of gradient %r (step %d)",
                                         by_tid[tid].name, self._bc_iteration + 1),
                    lambda tid: self._bc_client.push_pull_split(
                        tid, self._bc_iteration, by_tid[tid].codec.dense))
                for i, slot in enumerate(self._bc_slots):
                    if slot.param.device.type == "cuda" or sharded:
                        slot.staged = self._bc_staging.new_slot(slot.tid, slot.buf)
                    if sharded:
                        slot.staged.shard = self._bc_intra.flow
                        self._bc_intra.prepare(slot.tid, slot.param, i)
                if sharded:
                    self._bc_staging.bounded_wait = self._bc_intra.bounded_wait
            self._bytecomp_place(client)
        except BaseException:
            if getattr(self, "_bc_pinned", None) is not None:
                _staging.unregister_host_range(self._bc_pinned)
                self._bc_pinned = None
            client.close()
            self._bc_intra.close()
            raise
        self._bc_client = client
        self._bc_hooks = []
        for slot in self._bc_slots:
            hook = self._bytecomp_hook(slot)
            if hasattr(slot.param, "register_post_accumulate_grad_hook"):
                # PyTorch >= 2.1: the public hook, run once autograd has added
                # this backward's gradient into p.grad.
                self._bc_hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
                continue
            # PyTorch 1.x: the gradient accumulator of a leaf runs at the same
            # moment; reached through a view's grad_fn (Horovod's way).
            with torch.enable_grad():  # the optimizer may be built under no_grad()
                acc = slot.param.expand_as(slot.param).grad_fn.next_functions[0][0]
            acc.register_hook(hook)
            self._bc_hooks.append(acc)  # keep the accumulator alive

    def _bytecomp_place(self, client):
        """Which gradients this process compresses itself (the paper's GPU
        placement, docs/gpu.md §2): where the strategy the daemons run says
        `comp_device: gpu` for a float32 CUDA tensor and libbytecomp_gpu can
        (bytecomp.gpu.placement). Sets slot.place (the compressor spec) and
        self.placement_notes (why not, per tensor or for the whole job).
        BYTECOMP_CLIENT_COMPRESS=host (tests) takes CPU tensors too, with the
        CPU library standing in for the CUDA compressors behind the same ABI."""
        s = self._bc_ctx.settings
        host = os.environ.get("BYTECOMP_CLIENT_COMPRESS") == "host"
        self.placement_notes = {}
        self.gpu_profile = None  # mode: auto's measurement of the CUDA compressors
        st = self._bc_strategy if self._bc_strategy is not None else _strategy.load(s.strategy)
        why = None
        if st is None:
            why = "uncompressed (no strategy)"
        elif st.is_auto():
            why = "mode: auto: the plans change at run time, the daemon compresses"
            self._bytecomp_gpu_profile(st)
        elif not _lib.has_client_compression():
            why = "this libbytecomp has no bytecomp_push_pull_compressed (ABI 1.3)"
        elif s.num_nodes > 1 and s.local_size > 1 and self._bc_intra.flow is None:
            why = ("%d local ranks on %d nodes: compressed pushes need one local rank per node "
                   "(BYTECOMP_INTRA_NODE=nccl sends one shard per local rank instead)" %
                   (s.local_size, s.num_nodes))
        if why is not None:
            self.placement_notes["*"] = why
            return
        caps = _gpu.Capabilities(True, 1, lambda _n: True) if host else _gpu.capabilities()
        tensors = []
        for sl in self._bc_slots:
            if sl.param.dtype != torch.float32:
                continue
            dev = "cuda" if host and sl.param.device.type == "cpu" else sl.param.device.type
            tensors.append((sl.name, sl.buf.numel() * 4, dev))  # the shard's, if sharded
        placed = _gpu.placement(st.doc, tensors, caps)
        for sl in self._bc_slots:
            where, spec, why = placed.get(sl.name, ("none", "none", "not float32"))
            if where == "gpu":
                # cpu_share: the leading partitions stay dense for the daemon's
                # CPU pool (bytecomp_push_pull_split, docs/gpu.md §4).
                share = float(_gpu.resolve(st.doc, sl.name, sl.buf.numel() * 4)
                              .get("cpu_share", 0) or 0)
                if share > 0 and not _lib.has_split_push():
                    self.placement_notes[sl.name] = (
                        "cpu_share %s: this libbytecomp has no bytecomp_push_pull_split "
                        "(ABI 1.4); the daemon compresses it" % share)
                    continue
                sl.cpu_share = share
                sl.place = spec
            else:
                self.placement_notes[sl.name] = why
        if any(sl.place is not None for sl in self._bc_slots):
            # The payload layout follows the daemon's partitions: a multi-node
            # job knows them once joined (every node starting meanwhile).
            # Waiting here keeps the first iteration's gradients on the same
            # placement (and error feedback) as the others.
            deadline = time.monotonic() + s.start_timeout_ms / 1000.0
            while client.partition_bytes() == 0:
                if time.monotonic() > deadline:
                    raise _lib.BytecompTimeout(
                        "BYTECOMP_ERR_TIMEOUT",
                        "the daemon did not publish the job's partition size within %d ms "
                        "(the other nodes did not join?)" % s.start_timeout_ms)
                time.sleep(0.002)
            for sl in self._bc_slots:
                self._bytecomp_codec(sl, client)  # a tensor that cannot goes back to the daemon

    def _bytecomp_gpu_profile(self, st):
        """mode: auto: local rank 0 measures the CUDA compressors on its
        device (or says why not) and reports to its daemon, whose auto tuner
        carries them in the node's profile (bytecomp/gpu_profile.py). Sets
        self.gpu_profile = {"note": ..., "compressors": {spec: points}}."""
        from bytecomp import ctl as _ctl
        from bytecomp import gpu_profile as _gp
        s = self._bc_ctx.settings
        self.gpu_profile = None
        if s.local_rank != 0:
            return  # one report per node
        note, measured = _gp.profile(st.doc, self._bc_cuda_device)
        self.gpu_profile = {"note": note, "compressors": measured}
        try:
            answer = _ctl.request(s.socket_path or _ctl.DEFAULT_SOCKET, "gpu_profile",
                                  "%s\n%s" % (self._bc_daemon_job, _gp.report_text(note, measured)),
                                  timeout=5.0)
        except _ctl.CtlError as e:
            warnings.warn("bytecomp: the GPU profile did not reach the daemon: %s (auto plans "
                          "without it)" % e)
            return
        self.gpu_profile["daemon"] = answer.strip()

    def _bytecomp_codec(self, slot, client=None):
        """The slot's PartitionCodec (made at start, once the daemon
        published the job's partition size); None: pushed dense. Laid out by
        the tensor's own partitions (the job's cut into its strategy's
        `pieces`), as the daemon publishes them."""
        if slot.codec is not None or slot.place is None:
            return slot.codec
        pb, _parts = (client or self._bc_client).tensor_partitions(slot.tid)
        if pb == 0:
            return None  # a multi-node job not joined yet: the daemon compresses
        p = slot.param
        job = self._bc_daemon_job
        try:
            if p.device.type == "cuda":
                slot.codec = _gpu.PartitionCodec(slot.place, slot.buf.numel(), pb, job,
                                                 slot.tid, _gpu.GpuCompressor,
                                                 _TorchCudaCodecOps(p.device), slot.cpu_share)
            else:
                slot.codec = _gpu.PartitionCodec(
                    slot.place, slot.buf.numel(), pb, job, slot.tid,
                    lambda spec, n: _gpu.GpuCompressor(spec, n, host=True), _HostCodecOps(),
                    slot.cpu_share)
        except _lib.UnsupportedError as e:
            # Every local rank decides the same way (same build, same sizes).
            self.placement_notes[slot.name] = str(e)
            slot.place = None
            return None
        return slot.codec

    def _bytecomp_encoder(self, slot):
        """StagedSlot.encode for a CUDA gradient compressed on the device."""
        codec = self._bytecomp_codec(slot)
        if codec is None:
            return None
        host_bytes = slot.buf.view(-1).view(torch.uint8)

        def encode(grad, side):
            codec.encode(grad.data_ptr(), host_bytes, self._bc_iteration, side, grad)
        return encode

    def _bytecomp_hook(self, slot):
        def hook(*_):
            if self._bc_client is None or self._bc_failed is not None:
                return
            if slot.pending is not None:
                # overlap_forward: the forward used this parameter before its
                # update (its module's pre-hook did not run: e.g. a parent
                # read the submodule's weight directly), so this gradient is
                # of the old value; stepping on it would diverge silently.
                raise StateError(
                    "BYTECOMP_ERR_STATE",
                    "overlap_forward: the gradient of %r was computed from its value before "
                    "the last step()'s update: the forward used the parameter without calling "
                    "the forward of the module that owns it (whose pre-hook applies the "
                    "update). Call that module, call optimizer.drain() before the forward, or "
                    "use the default overlap_forward=None" % (slot.name,))
            slot.passes += 1
            if slot.passes > self._bc_passes:
                raise StateError(
                    "BYTECOMP_ERR_STATE",
                    "gradient of %r was computed %d times since the last step() "
                    "(backward_passes_per_step=%d): call optimizer.step() after each "
                    "backward, or raise backward_passes_per_step" %
                    (slot.name, slot.passes, self._bc_passes))
            if slot.passes == self._bc_passes:
                self._bytecomp_push(slot)
        return hook

    def _bytecomp_push(self, slot):
        p = slot.param
        if slot.staged is not None:
            with torch.no_grad():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self._bc_predivide != 1.0:
                    p.grad.mul_(1.0 / self._bc_predivide)
                if slot.place is not None and not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
            slot.handle = True  # staged: the pipeline holds the daemon's handle
            try:
                slot.staged.encode = self._bytecomp_encoder(slot)
                self._bc_staging.grad_ready(slot.staged, p.grad)
            except BytecompError as e:
                self._bc_failed = e
                self._bc_intra.abort()  # the other local ranks' collectives end too
                self._bc_ctx.failed = True
                raise
            return
        if p.grad is None or p.grad.data_ptr() != slot.buf.data_ptr():
            # Someone replaced p.grad (e.g. zero_grad(set_to_none=True) on the
            # wrapped optimizer): bring it back into shared memory.
            with torch.no_grad():
                if p.grad is None:
                    slot.buf.zero_()
                else:
                    slot.buf.copy_(p.grad)
            p.grad = slot.buf
        if self._bc_predivide != 1.0:
            with torch.no_grad():
                slot.buf.mul_(1.0 / self._bc_predivide)
        try:
            codec = self._bytecomp_codec(slot)
            if codec is not None:
                # In-process compression of a CPU gradient (the host stand-in):
                # the payloads overwrite the buffer, so compress from a copy.
                g = slot.buf.clone()
                codec.encode(g.data_ptr(), slot.buf.view(-1).view(torch.uint8),
                             self._bc_iteration, None, g)
                slot.handle = self._bc_client.push_pull_split(slot.tid, self._bc_iteration,
                                                              codec.dense)
            else:
                slot.handle = self._bc_client.push_pull(slot.tid, self._bc_iteration)
        except BytecompError as e:
            self._bc_failed = e
            self._bc_intra.abort()  # the other local ranks' collectives end too
            self._bc_ctx.failed = True
            raise

    # -- overlap_forward: the next forward waits per module ------------------
    def _bytecomp_check_overlap(self, model):
        """Refuses, before the job starts (every rank alike), what the
        per-module waits cannot do exactly as step() would."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError("DistributedOptimizer: overlap_forward=%r must be the "
                            "torch.nn.Module whose forward uses the parameters (or None)" %
                            (type(model).__name__,))
        base = type(self).__mro__[1]
        if base not in _PER_PARAMETER_OPTIMIZERS:
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "DistributedOptimizer: overlap_forward cannot split %s.step() into one step "
                "per parameter (supported: %s; subclasses too may couple parameters): use "
                "the default overlap_forward=None" %
                (base.__name__, ", ".join(sorted(c.__name__ for c in _PER_PARAMETER_OPTIMIZERS))))
        if self._bc_cuda_device is not None or _intra.mode() != "daemon":
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "DistributedOptimizer: overlap_forward supports CPU parameters without "
                "BYTECOMP_INTRA_NODE (this job has %s): use the default overlap_forward=None" %
                ("CUDA parameters" if self._bc_cuda_device is not None else
                 "BYTECOMP_INTRA_NODE=%s" % _intra.mode()))
        in_model = {id(p) for p in model.parameters()}
        outside = [name for name, p in self._bc_params if id(p) not in in_model]
        if outside:
            raise ValueError("DistributedOptimizer: overlap_forward: parameter %r (and %d "
                             "more) is not a parameter of the model passed: its forward could "
                             "not wait for it" % (outside[0], len(outside) - 1))

    def _bytecomp_overlap_hooks(self, model):
        """Per module with parameters of its own: a forward pre-hook that
        applies their pending updates, and the same before the module's
        state_dict() is read (a post-hook: the dict holds the parameters'
        storage, updated in place) and before load_state_dict() writes."""
        slot_of = {id(sl.param): sl for sl in self._bc_slots}
        done = set()
        for mname, m in model.named_modules():
            slots = []
            for p in m._parameters.values():
                sl = slot_of.get(id(p)) if p is not None else None
                if sl is not None and id(sl) not in {id(x) for x in slots}:
                    slots.append(sl)
            if not slots or id(m) in done:
                continue
            done.add(id(m))
            where = "the forward of module %r" % (mname or type(m).__name__)

            def pre(module, inputs, slots=slots, where=where):
                if self._bc_pending:
                    self._bytecomp_apply_slots(slots, where)

            def sd_post(module, destination, prefix, local_metadata, slots=slots):
                if self._bc_pending:
                    self._bytecomp_apply_slots(slots, "state_dict()")

            def load_pre(*_, slots=slots):
                if self._bc_pending:
                    self._bytecomp_apply_slots(slots, "load_state_dict()")

            self._bc_module_hooks.append(_first_forward_pre_hook(m, pre))
            # The public forms where present (PyTorch 2.x), the private ones
            # of 1.13 (same call; the load pre-hook there without `module`).
            if hasattr(m, "register_state_dict_post_hook"):
                self._bc_module_hooks.append(m.register_state_dict_post_hook(sd_post))
            else:
                self._bc_module_hooks.append(m._register_state_dict_hook(sd_post))
            if hasattr(m, "register_load_state_dict_pre_hook"):
                self._bc_module_hooks.append(m.register_load_state_dict_pre_hook(load_pre))
            else:
                self._bc_module_hooks.append(m._register_load_state_dict_pre_hook(load_pre))

    def _bytecomp_apply_slots(self, slots, where):
        for sl in slots:
            if sl.pending is not None:
                self._bytecomp_apply(sl, where)

    def _bytecomp_apply(self, slot, where):
        """Waits (bounded) for the sum step() left in flight for this slot and
        applies exactly what step() would have: the average, then the wrapped
        optimizer's step on this one parameter with the hyperparameters of its
        group as they were at step()."""
        if self._bc_client is None:
            raise NotInitializedError("DistributedOptimizer used after bytecomp.torch.shutdown()")
        if self._bc_failed is not None:
            raise self._bc_failed
        handle, group, iteration = slot.pending
        try:
            _wait(self._bc_client, handle, self._bc_timeout_ms,
                  "push_pull of gradient %r (step %d, waited for in %s)", slot.name,
                  iteration + 1, where)
        except BytecompError as e:
            if not isinstance(e, _lib.BytecompTimeout):
                # The daemon's cause, and where the program waited for it.
                try:
                    e = type(e)(e.status, "%s (gradient %r of step %d, waited for in %s)" %
                                (e.message, slot.name, iteration + 1, where))
                except Exception:  # noqa: BLE001 - keep the original then
                    pass
            self._bc_failed = e
            self._bc_ctx.failed = True  # no exit barrier: the job is broken
            raise e
        slot.pending = None
        self._bc_pending -= 1
        scale = 1.0
        if self._bc_op == Average:
            scale = self._bc_predivide / self._bc_ctx.settings.size
        with torch.no_grad():
            if scale != 1.0:
                slot.buf.mul_(scale)
            p = slot.param
            if p.grad is None or p.grad.data_ptr() != slot.buf.data_ptr():
                p.grad = slot.buf
        _step_one(self, type(self).__mro__[1], p, group)
        if slot.zero_after:
            slot.zero_after = False
            with torch.no_grad():
                slot.buf.zero_()

    def _bytecomp_defer(self):
        """step() with overlap_forward: pushes what backward did not, records
        each sum as pending with its group's hyperparameters of now (an LR
        scheduler may change them before the next forward) and returns."""
        if self._bc_client is None:
            raise NotInitializedError("DistributedOptimizer used after bytecomp.torch.shutdown()")
        if self._bc_failed is not None:
            raise self._bc_failed
        for slot in self._bc_slots:
            if slot.handle is None:
                if slot.pending is not None:
                    # Not used by the last forward: its previous update first.
                    self._bytecomp_apply(slot, "step()")
                self._bytecomp_push(slot)
        group_of = {}
        for g in self.param_groups:
            snap = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items()
                    if k != "params"}
            for p in g["params"]:
                group_of[id(p)] = snap
        for slot in self._bc_slots:
            slot.pending = (slot.handle, group_of[id(slot.param)], self._bc_iteration)
            slot.handle = None
            slot.passes = 0
        self._bc_pending = len(self._bc_slots)
        self._bc_iteration += 1

    def drain(self):
        """overlap_forward: waits for every sum still in flight and applies the
        updates step() left pending (the next forward, state_dict() and
        shutdown() do it too). Then the parameters are what they would be
        after step() without overlap_forward. Without it: nothing to do."""
        if self._bc_pending:
            self._bytecomp_apply_slots(self._bc_slots, "drain()")

    # -- public ------------------------------------------------------------
    def synchronize(self):
        """Pushes the gradients backward did not produce, waits for all of
        them (bounded by BYTECOMP_TIMEOUT_MS) and averages (op=Average).
        Call it before working on the averaged gradients (e.g. clipping):
        the next step() then does not sum them again (nor does a second
        synchronize() before that step)."""
        if self._bc_client is None:
            raise NotInitializedError("DistributedOptimizer used after bytecomp.torch.shutdown()")
        if self._bc_failed is not None:
            raise self._bc_failed
        if self._bc_synced:
            return
        if self._bc_pending:
            # overlap_forward: last step()'s updates not applied yet (their
            # parameters were not used by the forward since).
            self._bytecomp_apply_slots(self._bc_slots, "synchronize()")
        try:
            for slot in self._bc_slots:
                if slot.handle is None:
                    self._bytecomp_push(slot)
            if self._bc_staging is not None:
                self._bc_staging.drain()
            for slot in self._bc_slots:
                h, slot.handle = slot.handle, None
                if slot.staged is not None:
                    self._bc_staging.copy_back(slot.staged, slot.param.grad)
                    continue
                _wait(self._bc_client, h, self._bc_timeout_ms,
                      "push_pull of gradient %r (step %d)", slot.name, self._bc_iteration + 1)
            if self._bc_staging is not None:
                self._bc_staging.finish([sl.staged for sl in self._bc_slots
                                         if sl.staged is not None])
            if self._bc_intra.flow is not None:
                # The allgathers done, within the communicator's bound: a
                # local rank that died mid-step aborts it here, instead of
                # leaving the compute stream waiting on it forever.
                self._bc_intra.bounded_wait(self._bc_intra.ops.side_stream())
        except BytecompError as e:
            self._bc_failed = e
            self._bc_intra.abort()  # the other local ranks' collectives end too
            self._bc_ctx.failed = True  # no exit barrier: the job is broken
            if self._bc_staging is not None:
                self._bc_staging.abandon()
            raise
        for slot in self._bc_slots:
            slot.passes = 0
        self._bc_iteration += 1
        self._bc_synced = True
        scale = 1.0
        if self._bc_op == Average:
            scale = self._bc_predivide / self._bc_ctx.settings.size
        if scale != 1.0:
            with torch.no_grad():
                for s in self._bc_slots:
                    # Staged gradients: on the device, after the copy back
                    # (the compute stream waits for it in finish()).
                    (s.param.grad if s.staged is not None else s.buf).mul_(scale)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's: step() inside this block does not synchronize; call
        synchronize() before it (e.g. to clip the summed gradients):

            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        self._bc_skip_sync = True
        try:
            yield
        finally:
            self._bc_skip_sync = False

    def step(self, closure=None):
        if self._bc_skip_sync and not self._bc_synced and self._bc_client is not None:
            # Stepping on this rank's own gradients would let the ranks'
            # parameters drift apart silently.
            raise StateError(
                "BYTECOMP_ERR_STATE",
                "step() inside skip_synchronize() without synchronize() since the last "
                "step(): call optimizer.synchronize() first (the gradients are not summed)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._bc_overlap is not None and not self._bc_synced:
            # The next forward's pre-hooks wait, per module, and step then.
            self._bytecomp_defer()
            return loss
        self.synchronize()
        super(self.__class__, self).step()
        self._bc_synced = False  # the next step() sums the next gradients
        return loss

    def report_loss(self, loss):
        """Reports this process's training loss (a number or a 0-d tensor)
        to its daemon, for the auto strategy's loss guard (docs/auto.md,
        "Loss rollback"): after a switch to compression the daemon compares
        the reported losses with the uncompressed warm-up's and rolls the job
        back to uncompressed when they diverge. Call it once per step. A
        job that is not auto ignores it (and this stops sending); a daemon
        that cannot be reached is warned about once and training goes on:
        the guard only loses reports. Bounded: 2 s per report."""
        if self._bc_loss_off or self._bc_client is None:
            return
        value = float(loss.detach().item() if torch.is_tensor(loss) else loss)
        from bytecomp import ctl as _ctl  # the operator channel (bytecompctl's)
        try:
            answer = _ctl.request(self._bc_ctx.settings.socket_path, "loss",
                                  "%s %r" % (self._bc_daemon_job, value), timeout=2.0)
        except _ctl.CtlError as e:
            if not self._bc_loss_warned:
                self._bc_loss_warned = True
                warnings.warn("bytecomp: report_loss: %s (the loss guard misses this report)"
                              % e)
            return
        if answer.startswith("ignored"):
            self._bc_loss_off = True

    def zero_grad(self, set_to_none=False):
        """Zeroes gradients in place: they stay in shared memory (set_to_none
        is accepted for compatibility and treated as False)."""
        if self._bc_client is None:
            return super(self.__class__, self).zero_grad(set_to_none)
        if any(s.handle is not None for s in self._bc_slots):
            raise StateError(
                "BYTECOMP_ERR_STATE",
                "zero_grad() while gradients are being summed (backward ran since the last "
                "step()): call optimizer.step() or optimizer.synchronize() first")
        with torch.no_grad():
            for s in self._bc_slots:
                s.passes = 0
                if s.pending is not None:
                    # overlap_forward: the daemon still writes the sum there;
                    # zeroed once the update used it.
                    s.zero_after = True
                    continue
                if s.staged is not None:
                    if s.param.grad is None:
                        s.param.grad = torch.zeros_like(s.param)
                    else:
                        s.param.grad.zero_()
                    continue
                s.buf.zero_()
                if s.param.grad is None or s.param.grad.data_ptr() != s.buf.data_ptr():
                    s.param.grad = s.buf

    def state_dict(self):
        self.drain()  # overlap_forward: the state (momentum, ...) of every step
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict):
        if getattr(self, "_bc_pending", 0):
            self.drain()  # else a pending update would step on the loaded state
        return super(self.__class__, self).load_state_dict(state_dict)

    def _bytecomp_drain_for_close(self):
        """shutdown(): applies pending updates (overlap_forward) so no sum is
        in flight when the process leaves; raises what the wait raised."""
        if self._bc_client is not None and self._bc_failed is None and self._bc_pending:
            self.drain()

    def _bytecomp_detach(self):
        """Leaves the job: gradients move out of shared memory first."""
        client, self._bc_client = self._bc_client, None
        if client is None:
            return
        for h in self._bc_module_hooks:
            h.remove()
        self._bc_module_hooks = []
        if self._bc_failed is not None:
            # Before any device synchronize: an NCCL collective stuck on a
            # dead local rank would otherwise block the synchronizes below
            # forever; aborting the communicator ends its kernels.
            self._bc_intra.abort()
        with torch.no_grad():
            for s in self._bc_slots:
                if s.param.grad is not None and s.param.grad.data_ptr() == s.buf.data_ptr():
                    s.param.grad = s.buf.clone()
                s.buf = None
                if s.codec is not None:
                    if s.param.device.type == "cuda":
                        torch.cuda.synchronize(s.param.device)  # no compress in flight
                    s.codec.close()
                    s.codec = None
        self._bc_slots = []
        if self._bc_pinned is not None:
            # No copy may still read or write the shared memory.
            torch.cuda.synchronize(self._bc_cuda_device)
            _staging.unregister_host_range(self._bc_pinned)
            self._bc_pinned = None
        self._bc_staging = None
        for h in self._bc_hooks:
            if hasattr(h, "remove"):  # post-accumulate hook handles (PyTorch >= 2.1)
                h.remove()
        self._bc_hooks = []
        client.close()
        self._bc_intra.close()


# torch.optim classes whose step() updates each parameter from its own
# gradient and state only (their single-tensor and foreach paths loop over
# parameters): a step on one parameter at a time gives the same bits.
# LBFGS (one closure over all parameters) and unknown classes are refused.
_PER_PARAMETER_OPTIMIZERS = frozenset(
    c for c in (getattr(torch.optim, n, None) for n in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
        "RMSprop", "Rprop")) if c is not None)


def _first_forward_pre_hook(module, hook):
    """register_forward_pre_hook, run before the module's other pre-hooks:
    one that computes from the parameters (torch.nn.utils.weight_norm's
    weight from weight_g and weight_v) must see them updated."""
    try:
        return module.register_forward_pre_hook(hook, prepend=True)  # PyTorch >= 2.0
    except TypeError:
        handle = module.register_forward_pre_hook(hook)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)  # 1.13: an OrderedDict
        return handle


def _unhooked_step(cls):
    """cls.step without the step-hook wrapper PyTorch >= 2.0 puts around it
    (Optimizer._patch_step_function, marked `hooked`): the per-parameter
    steps of overlap_forward must not run the user's step hooks once per
    parameter (they run once, around DistributedOptimizer.step())."""
    f = cls.step
    if getattr(f, "hooked", False) and hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


def _step_one(opt, cls, p, group):
    """cls.step (the wrapped optimizer's) on parameter p alone, with the
    hyperparameters `group` (a dict without "params"); opt.state is shared."""
    saved = opt.param_groups
    opt.param_groups = [dict(group, params=[p])]
    try:
        _unhooked_step(cls)(opt)
    finally:
        opt.param_groups = saved


class _Scratch:
    __slots__ = ("t", "ptr")

    def __init__(self, t):
        self.t = t
        self.ptr = t.data_ptr()


class _TorchCudaCodecOps:
    """bytecomp.gpu.PartitionCodec's device side: scratch in device memory,
    payload copies device -> pinned shared memory on the side stream."""

    def __init__(self, device):
        self.device = device

    def scratch(self, nbytes):
        return _Scratch(torch.empty(max(int(nbytes), 8), dtype=torch.uint8, device=self.device))

    def raw(self, stream):
        return stream.cuda_stream

    def copy(self, host_bytes, offset, scratch, n, stream):
        # The next iteration's compress into `scratch` and d2h into the host
        # buffer run after this copy on the same (side) stream.
        with torch.cuda.stream(stream):
            host_bytes[offset:offset + n].copy_(scratch.t[:n], non_blocking=True)

    def copy_dense(self, host_bytes, offset, src, stream):
        # A cpu_share partition: the gradient's bytes as they are.
        with torch.cuda.stream(stream):
            host_bytes[offset:offset + src.numel() * 4].view(torch.float32).copy_(
                src, non_blocking=True)


class _HostCodecOps:
    """The host stand-in's side (BYTECOMP_CLIENT_COMPRESS=host)."""

    def scratch(self, nbytes):
        return _Scratch(torch.empty(max(int(nbytes), 8), dtype=torch.uint8))

    def raw(self, stream):
        return 0

    def copy(self, host_bytes, offset, scratch, n, stream):
        host_bytes[offset:offset + n].copy_(scratch.t[:n])

    def copy_dense(self, host_bytes, offset, src, stream):
        host_bytes[offset:offset + src.numel() * 4].view(torch.float32).copy_(src)


class _Slot:
    __slots__ = ("name", "param", "tid", "buf", "handle", "passes", "staged", "place", "codec",
                 "cpu_share", "pending", "zero_after")

    def __init__(self, name, param, tid, buf):
        self.name = name
        self.param = param
        self.tid = tid
        self.buf = buf  # shared memory: the gradient (CPU) or its staging (CUDA)
        self.handle = None
        self.passes = 0
        self.staged = None  # _staging.StagedSlot of a CUDA parameter
        self.place = None  # compressor spec when this process compresses it (GPU placement)
        self.codec = None  # its bytecomp.gpu.PartitionCodec, once made
        self.cpu_share = 0.0  # of its partitions, the daemon's CPU pool compresses (strategy)
        # overlap_forward: (handle, group hyperparameters, iteration) of a sum
        # step() did not wait for; its update is applied by the next forward.
        self.pending = None
        self.zero_after = False  # zero_grad() came while pending


def _compression_strategy(compression):
    """Horovod's compression= as this job's own strategy: every gradient
    through the daemons' compressor of the same kind."""
    kind = getattr(compression, "strategy_compressor", None)
    if kind is None:
        raise ValueError("DistributedOptimizer: compression=%r: supported are "
                         "bytecomp.torch.Compression.none and .fp16 (other compressors: "
                         "strategy=FILE or strategy='auto', docs/strategy-format.md)" %
                         (compression,))
    if kind == "none":
        return None
    doc = {"version": 1, "default": {"compressor": kind}}
    return _strategy.Strategy("<compression=%s>" % kind, yaml.safe_dump(doc), doc)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, strategy=None, compressors=None,
                         exclude=None, overlap_forward=None):
    """Wraps `optimizer` so gradients are summed over every process of the
    job (and averaged, op=Average) before each step.

    named_parameters: model.named_parameters() of the parameters the optimizer
        updates; the names are the tensor names the strategy matches (without
        it, parameters are called param.0, param.1, ... in optimizer order).
    strategy: path of a strategy file (docs/strategy-format.md) choosing per
        tensor whether and how to compress. The node daemons execute it; they
        run the strategy of their configuration, so this must be that file
        ($BYTECOMP_STRATEGY, set by `bytecomp-run --strategy`), else
        UnsupportedError. None: whatever the daemons run (uncompressed unless
        they were given a strategy). "auto": the runtime chooses per tensor
        from measurements of this job (docs/auto.md), among `compressors`
        (e.g. ["efsignsgd", "topk:0.01"]; None: fp16 only), fp16 and
        nothing; tensors matching an `exclude` glob (e.g. ["conv1.*",
        "fc.*"]) stay uncompressed.
    backward_passes_per_step: backward passes accumulated locally per step.
    compression, op, gradient_predivide_factor: Horovod's (Compression.none
        or .fp16, the daemons' fp16 compressor on every gradient; Average or
        Sum). The third positional argument is Horovod's compression; a path
        there (this package's older signature) is taken as strategy.
    num_groups, groups, sparse_as_dense, process_set: Horovod's; only their
        defaults (the daemons group and schedule tensors themselves).
    overlap_forward: None (step() waits for every sum and steps), or the
        model (torch.nn.Module) whose parameters the optimizer updates:
        step() then returns without waiting, and the next forward waits per
        module, before it runs, for the sums of that module's own parameters
        and applies their updates (state_dict(), load_state_dict(),
        optimizer.drain(), the next step() and shutdown() apply the rest).
        The parameters are bit for bit those of the default after each
        step. CPU parameters; the torch.optim optimizers that step each
        parameter alone (SGD, Adam, AdamW, ...; not LBFGS). docs/torch.md.

    The result is an instance of the optimizer's own class (isinstance and LR
    schedulers keep working)."""
    _ctx_or_raise("DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("DistributedOptimizer: expected a torch.optim.Optimizer, got %s" %
                        type(optimizer).__name__)
    if hasattr(optimizer, "_bc_job"):
        raise ValueError("DistributedOptimizer: the optimizer is already distributed")
    _check_process_set("DistributedOptimizer", process_set)
    if num_groups or groups is not None or sparse_as_dense:
        raise ValueError("DistributedOptimizer: num_groups, groups and sparse_as_dense are not "
                         "supported (the daemons group and schedule tensors themselves; "
                         "gradients are dense); leave them at their defaults")
    if compression is None or isinstance(compression, (str, _strategy.Strategy)) or \
            hasattr(compression, "__fspath__"):
        # The older signature's third positional argument: strategy.
        if strategy is not None and compression is not None:
            raise ValueError("DistributedOptimizer: strategy given twice (%r and %r)" %
                             (compression, strategy))
        strategy, compression = compression if strategy is None else strategy, Compression.none
    elif isinstance(compression, type) and issubclass(compression, Compressor) or \
            isinstance(compression, Compressor):
        from_compression = _compression_strategy(compression)
        if from_compression is not None:
            if strategy is not None:
                raise ValueError("DistributedOptimizer: pass compression= or strategy=, not "
                                 "both (compression=%r, strategy=%r)" % (compression, strategy))
            strategy = from_compression
    else:
        _compression_strategy(compression)  # raises with the accepted values
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, strategy, backward_passes_per_step,
               op, optimizer, compressors, exclude, gradient_predivide_factor, overlap_forward)
