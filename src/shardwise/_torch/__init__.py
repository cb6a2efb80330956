"""Every private torch API shardwise uses, one small module per family (torch 2.13, pinned).

No other module of shardwise (`testing/` aside) may touch a private torch name; each one here
says what it wraps and why shardwise needs it. tests/test_torch_private_apis.py checks that
each API is still there with the shape shardwise relies on, and scans the rest of the package
for private torch names (`test_private_torch_apis_only_in_torch_package`).

- `autograd_engine`: the running backward's graph task, whether it runs a node, callbacks at
  its end, an autograd Function's backward node class.
- `storage`: storage identity and reference count, a view's base.
- `function_modes`: the torch-function mode stack.
- `subclass`: ``Tensor._make_subclass`` (how every Parameter is built).
- `module_state`: a module's own parameter and buffer dicts.
- `tensor_hooks`: a tensor's backward hook dict, handed to autograd again.
- `c10d`: backend options with a timeout, the default store, the fake process group, the
  store classes (typed).
- `dtensor`: ``_StridedShard`` and DTensor's sharding propagator.
- `dispatch` / `fake`: dispatch-level modes and op types; fake tensors.
- `profiler_events`: the profiler's event tree (allocation records).
- `pytree`: torch's pytree functions.
- `functorch`: whether a ``torch.func`` transform runs, and which.

The submodules are imported where used (none here: fake tensors and DTensor import slowly).
"""
