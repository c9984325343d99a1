"""vLLM's ExampleHiddenStatesConnector for its CPU backend, loaded by vLLM through `kv_connector_module_path`
(data/vllm_capture.py sets it when vLLM's platform is the CPU). Imported only inside vLLM.

The stock connector (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py) takes a finished
request's states out of the hidden-state cache on a side CUDA stream into pinned host memory, and reports the request
done once a CUDA event says the copy landed (`get_finished` calls its `query()`). vLLM's CPU worker has no CUDA streams
or events (its placeholder event has no `query()`) and no pinned memory. On a CPU the cache already lies in host
memory, so the copy is a plain clone, finished when it returns: this subclass overrides only that step and hands the
rest (lock files, the writer threads, the scheduler's bookkeeping) to the stock code.
"""

from __future__ import annotations

from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Landed:
    """Stands where the stock connector keeps a CUDA event of the copy: a clone on the host has landed already."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # (n_blocks,)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()  # (n_blocks * bs,)
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # (S, n_ids, H)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken by the stock wait_for_save when it arrived
        future = self._executor.submit(self._write_tensors, {"hidden_states": states,
                                                             "token_ids": pending.token_ids.clone()},
                                       _Landed, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Landed
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
