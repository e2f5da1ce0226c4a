"""Every place where this project patches, or works around, code of megatron-core 0.19.2 (or of NVRx 0.6.0, torch 2.13) names
that code here with a hash of its source: when an upgrade changes it, this test fails and names the patch to
re-check (is it still needed, does it still fit?), instead of the patch going silently stale. docs/architecture.md
lists the same patches with their reasons."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from typing import NamedTuple

import pytest


class Patched(NamedTuple):
    upstream: str  # the qualified name of the function whose behaviour the patch depends on
    source_sha256: str  # the first 16 hex digits of sha256(inspect.getsource(upstream))
    ours: str  # where the patch or workaround lives


PATCHED = [
    # QK-clip: megatron-core's clip_qk reaches the decoder through Megatron-LM's two wrappers, which
    # training/qk_clip.py stands in for
    Patched("megatron.core.optimizer.qk_clip.clip_qk", "283de85830761096", "training/qk_clip.py"),
    # export-hf's --max-shard-size checked before the export with huggingface_hub's own (private) size parser
    Patched("huggingface_hub.serialization._base.parse_size_to_int", "cf70d85d90faf113", "convert/hf_files.py"),
    # CPU rehearsal (megatron_ext/distributed/cpu_backend.py): the CUDA RNG on the CPU generator
    Patched("megatron.core.tensor_parallel.random._get_cuda_rng_state", "aa26caaa069c5c4f", "distributed/cpu_backend.py"),
    Patched("megatron.core.tensor_parallel.random._set_cuda_rng_state", "b179c9d95438b61c", "distributed/cpu_backend.py"),
    # CPU rehearsal: OptimizerConfig's TE version check, which fails without TE
    Patched("megatron.core.optimizer.optimizer_config.OptimizerConfig.__post_init__", "8d06c93753e45143",
            "distributed/cpu_backend.py"),
    # CPU rehearsal: Megatron-FSDP's parameter all-gathers (alone and coalesced) complete before they return
    Patched("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.AllGatherPipeline."
            "async_bucket_gather", "4a9f0dac8eef8af9", "distributed/cpu_backend.py"),
    Patched("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.AllGatherPipeline."
            "all_gather_params", "4530f38ae3143f84", "distributed/cpu_backend.py"),
    # CPU rehearsal: offload of host tensors
    Patched("megatron.core.pipeline_parallel.fine_grained_activation_offload.ChunkOffloadHandler."
            "_can_manage_tensor_for_offload", "20d546c67b80fbf7", "model/activation_offload.py"),
    # one-layer virtual stages refused with activation offload (the offload margin empties a chunk)
    Patched("megatron.core.pipeline_parallel.fine_grained_activation_offload.PipelineOffloadManager."
            "post_warmup_callback", "fcd891e4c53934fd", "config/validate.py"),
    # the save's helper process started by the recipe (signals ignored, ends with its rank): for NVRx's async writer
    # and for megatron-core's own, which its synchronous save runs
    Patched("megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue",
            "e395fb0e86a062e2", "checkpoint/save_load.py"),
    Patched("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async.get_write_results_queue",
            "e395fb0e86a062e2", "checkpoint/save_load.py"),
    # megatron-core's synchronous save runs its own (deprecated) async writer and waits: the deprecation filtered
    Patched("megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy.async_save",
            "76a4d55fe07edb88", "checkpoint/save_load.py"),
    # HybridModel (model/hybrid.py): its stack's TE-only final norm replaced, Llama 3.1's RoPE scaling applied with
    # megatron-core's private scaling after the build, the fused output run through its forward as a middle stage's
    # (model/fused_output.py), GPT checkpoints read through its retargeting with this project's layer maps
    Patched("megatron.core.models.hybrid.hybrid_block.HybridStack.__init__", "8f31e2dfaa3491fa", "model/hybrid.py"),
    Patched("megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding._apply_scaling",
            "d0a18429087cc321", "model/hybrid.py"),
    Patched("megatron.core.models.hybrid.hybrid_model.HybridModel.forward", "5115982845f77289",
            "model/fused_output.py"),
    Patched("megatron.core.dist_checkpointing.gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint",
            "4bebb4f65786c057", "checkpoint/model_class.py"),
    # torch Adam's state on load: empty state asserted on, one shared step tensor, KeyError 'step'
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict", "fe621ae6a622b587",
            "checkpoint/compat.py"),
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict", "7e5f988b86b48501",
            "checkpoint/compat.py"),
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
            "40cab784659711a8", "checkpoint/compat.py"),
    # a saved param group is paired with the current one by its schedule's values too (max_lr, min_lr, start_wd, end_wd;
    # DistributedOptimizer.load_state_dict above, the other optimizers here): the saved values follow the config
    Patched("megatron.core.optimizer.optimizer.MegatronOptimizer._filter_and_reorder_param_groups", "08e55f3aea6499b7",
            "checkpoint/compat.py"),
    # the fully reshardable save cuts each parameter's state at its padded buffer offset from bucket-packed tensors
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_param_state_fully_reshardable",
            "6df6392a0ebb4c79", "checkpoint/optimizer_format.py"),
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero",
            "14d11a75ad9ccd8b", "checkpoint/optimizer_format.py"),
    # the dp_reshardable save's last padding shard of a DP rank runs past its bucket's checkpoint tensor
    Patched("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_param_state_dp_reshardable",
            "5e103700ca80a82a", "checkpoint/optimizer_format.py"),
    # the HSDP grad norm with the optimizer sharded across replicas
    Patched("megatron.core.optimizer.optimizer.MegatronOptimizer.get_grad_stats_parallel_group", "e9e42213a75e2cd1",
            "training/optimizer.py"),
    # gradient clipping's norm and coefficient kept on the device without TE's multi-tensor kernels
    Patched("megatron.core.optimizer.clip_grads.get_grad_norm_fp32", "810944e99b1e435d", "training/optimizer.py"),
    Patched("megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32", "cf07b488fb76a8ae",
            "training/optimizer.py"),
    # RowParallelLinear's GEMM without its TP group (a warning per forward, graph breaks under compile)
    Patched("megatron.core.tensor_parallel.layers.RowParallelLinear.forward", "d98cea58261aef07", "model/llama.py"),
    # experts marked expert-parallel only at EP > 1 or ETP != TP
    Patched("megatron.core.tensor_parallel.layers.ColumnParallelLinear.__init__", "20dcfe25ca5aa94b", "model/moe.py"),
    # the local spec's MoE pre-MLP norm under the dense fused-norm key
    Patched("megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec", "3072178d945b4d8b", "model/llama.py"),
    # batched p2p swaps the tensors of an interleaved pipeline at PP=2
    Patched("megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops", "4b0901807501c561",
            "model/llama.py"),
    # first and last stage overrides at PP=2 divide by zero (with virtual stages)
    Patched("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", "841de49f82bd7cc2",
            "config/validate.py"),
    # the native fused cross-entropy's gradient in bf16 whatever the precision
    Patched("megatron.core.fusions.fused_cross_entropy.calculate_gradients", "6524843bdf90ceea", "config/validate.py"),
    # torch's distributed checkpoint unpickles .metadata (pickle.load) and non-tensor items (weights_only=False)
    Patched("torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata", "8586ce344a523602",
            "checkpoint/safe_unpickle.py"),
    Patched("megatron_ext.checkpoint.safe_unpickle.REPLACED_LOAD_BYTES", "666701f9808c4bc2",
            "checkpoint/safe_unpickle.py"),
    # import-hf's streaming save (convert/streaming.py): megatron-core's torch_dist translation, then torch's writer
    # with a file per group (its write_data regrouped, its _write_data reused) resolving each tensor when it writes
    # it, and holding a file's tensors until the file is closed
    Patched("megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy.save", "e3bb2e822ccbabc8",
            "convert/streaming.py"),
    Patched("megatron.core.dist_checkpointing.strategies.torch._replace_state_dict_keys_with_sharded_keys",
            "36691fcc7c6ff384", "convert/streaming.py"),
    Patched("torch.distributed.checkpoint.filesystem._FileSystemWriter.write_data", "ff3210965b793f60",
            "convert/streaming.py"),
    Patched("torch.distributed.checkpoint.filesystem._FileSystemWriter._write_data", "a16804371a37b032",
            "convert/streaming.py"),
    Patched("torch.distributed.checkpoint.filesystem._write_files_from_queue", "f25c2a0692a7507e",
            "convert/streaming.py"),
    # checkpoints in object storage: the run lock's conditional uploads (If-None-Match / If-Match) through the storage
    # provider of multi-storage-client 0.50's client, which offers no conditional write of its own
    Patched("multistorageclient.providers.base.BaseStorageProvider.put_object", "8d11d734c9ed35ba", "storage/files.py"),
    # rank 0 writes metadata.json then every rank meets in a barrier: its failure is kept until after the barrier
    Patched("megatron.core.dist_checkpointing.serialization.save", "e9626ecdf679a001", "checkpoint/save_load.py"),
    # the dataset index cache is memory-mapped, so it cannot unpickle objects (tests/unit/test_dataset_cache_safety.py)
    Patched("megatron.core.datasets.gpt_dataset.GPTDataset._query_document_sample_shuffle_indices", "1c5dd2f8d68aff48",
            "data/datasets.py"),
    Patched("megatron.core.datasets.gpt_dataset.GPTDataset._build_document_sample_shuffle_indices", "31ef3869909a992b",
            "data/datasets.py"),
    Patched("megatron.core.datasets.blended_dataset.BlendedDataset.__getitem__", "ab4036c7afcbda7f",
            "data/datasets.py"),
    Patched("megatron.core.datasets.blended_dataset.BlendedDataset._build_indices", "c526c2c6ddd9d47e", "data/datasets.py"),
    # NVRx 0.6.0's agent drops the failures it saw when it runs out of restarts
    Patched("nvidia_resiliency_ext.fault_tolerance.launcher.LocalElasticAgent._invoke_run_with_any_failed_policy",
            "b2e2ac0dca2a2d6b", "resilience/agent.py"),
    # torch's elastic agent: a signal's exception leaves the rendezvous open (an agent leaving after exit 16), and the
    # rendezvous state holds the hot spares (redundancy list) beside the wait list it reports
    Patched("torch.distributed.launcher.api.launch_agent", "01534e5e0ad77098", "resilience/agent.py"),
    Patched("torch.distributed.elastic.agent.server.api.SimpleElasticAgent.run", "1f0bf1529692b17f",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler.num_nodes_waiting",
            "1029f8dd846980b6", "resilience/agent.py"),
    # a hot spare in the redundancy list leaves a closed rendezvous by the graceful exit whose None result the
    # launcher then fails on; the ranks' job store is named after the round, as torch prefixes the round's keys
    Patched("torch.distributed.elastic.rendezvous.dynamic_rendezvous._RendezvousJoinOp.__call__", "8ce27da4a0625024",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler._wrap_store",
            "7cfb065e563578ac", "resilience/agent.py"),
    # torch's elastic agent (and NVRx's ft_launcher subclass of it), whose methods resilience/agent.py's subclass
    # overrides (its launcher builds the subclass by the class's name, launch_agent above): restarts ended after errors
    # a restart repeats and the failures seen reported (_monitor_workers, _invoke_run), an unneeded hot spare ended
    # (run), restarts timed (_restart_workers, _initialize_workers, _rendezvous), the job store named (_rendezvous);
    # signals passed on as a stop with a checkpoint (_terminate_process_handler, a module function replaced in place)
    Patched("torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._monitor_workers",
            "4ba1c04fe76bba95", "resilience/agent.py"),
    Patched("torch.distributed.elastic.agent.server.api.SimpleElasticAgent._invoke_run", "376e457facabbfbc",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.agent.server.api.SimpleElasticAgent._restart_workers", "7de319cd35c6f36e",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.agent.server.api.SimpleElasticAgent._initialize_workers", "14311253e222ba2a",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.agent.server.api.SimpleElasticAgent._rendezvous", "f0c843d67c04a7fc",
            "resilience/agent.py"),
    Patched("torch.distributed.elastic.multiprocessing.api._terminate_process_handler", "690db341fcce4d93",
            "resilience/agent.py"),
    Patched("nvidia_resiliency_ext.fault_tolerance.launcher.LocalElasticAgent._monitor_workers", "219a518f9f2ad4e7",
            "resilience/agent.py"),
    Patched("nvidia_resiliency_ext.fault_tolerance.launcher.LocalElasticAgent._invoke_run", "a5b658f9a6ddfd0d",
            "resilience/agent.py"),
    Patched("nvidia_resiliency_ext.fault_tolerance.launcher.LocalElasticAgent.run", "4d9950799e905bc5",
            "resilience/agent.py"),
    # the document-mask hook hands GPTModel.forward the document ids as its attention_mask argument
    Patched("megatron.core.models.gpt.gpt_model.GPTModel.forward", "ecf2ffcb318347f6", "model/document_mask.py"),
    # MLA's shared rotary key: its gradient summed over TP (megatron-core leaves each rank its own heads' share)
    Patched("megatron.core.transformer.multi_latent_attention.MLASelfAttention._qkv_down_projection",
            "6e1c7d106c8c3ac1", "model/mla.py"),
    Patched("megatron.core.transformer.multi_latent_attention.MLASelfAttention.get_query_key_value_tensors",
            "e19fa46a2a0b1b23", "model/mla.py"),
]


def _resolve(qualified: str):
    parts = qualified.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    for name in parts[split:]:
        found = getattr(found, name)
        if isinstance(found, type) and found.__module__.startswith("megatron_ext"):
            found = found.__wrapped__  # a class this project replaced by its subclass (resilience/agent.py)
    return found


@pytest.mark.parametrize("patched", PATCHED, ids=[p.upstream.rsplit(".", 2)[-2] + "." + p.upstream.rsplit(".", 1)[-1]
                                                  for p in PATCHED])
def test_the_upstream_code_a_patch_depends_on_is_unchanged(patched):
    if patched.upstream.startswith("nvidia_resiliency_ext") and importlib.util.find_spec("nvidia_resiliency_ext") is None:
        pytest.skip("NVRx is not installed (make install unpacks it: launch/install_nvrx.sh)")
    # the upstream function itself, where this project wrapped it in place (resilience/agent.py sets __wrapped__)
    upstream = inspect.unwrap(_resolve(patched.upstream), stop=lambda f: not f.__module__.startswith("megatron_ext"))
    source = inspect.getsource(upstream)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == patched.source_sha256, (
        f"{patched.upstream} changed upstream (source sha256 {digest}, was {patched.source_sha256}): re-check the "
        f"patch in megatron_ext/{patched.ours} (docs/architecture.md says why it is there), then record the new hash")


def test_every_patch_site_exists():
    from tests.launch import ROOT

    missing = sorted({p.ours for p in PATCHED if not (ROOT / "megatron_ext" / p.ours).is_file()})
    assert not missing, missing


def test_torchs_flight_recorder_dump_is_there_for_the_hang_watchdog():
    """resilience/flight_recorder.py writes torch's private ``_dump_fr_trace`` (a C function: no source to hash):
    it must still return the pickled trace the analyser reads (tests/integration/test_failures.py reads a real one)."""
    from torch._C import _distributed_c10d

    assert callable(getattr(_distributed_c10d, "_dump_fr_trace", None))

