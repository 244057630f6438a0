"""The scripts chapter 11 starts with ``torchrun``, one process per GPU (shipped with the package,
so a pip-installed reader has them too). ``cudabook.dist.torchrun("ddp_train", 4)`` finds them by
name; by hand, with the folder that ``python -c "import cudabook.dist_scripts as d;
print(d.__path__[0])"`` prints (``cudabook/dist_scripts`` in the repository):

    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/allreduce_sweep.py --max-bytes 1G
    torchrun --standalone --nproc_per_node 4 cudabook/dist_scripts/ddp_train.py

allreduce_sweep  NCCL (or gloo, --cpu) all-reduce time and bus bandwidth, 4 KB to 1 GB
ddp_train        data-parallel training of a compute-bound MLP: DDP, buckets after the backward,
                 the chapter's own buckets and hooks; its ``make_model`` is also the model of
                 ``cudabook.dataparallel`` (one process, the book's P2P ring)
sharded_train    ZeRO-1/2/3 (cudabook.sharded) against DDP and torch's FSDP2, on ddp_train's model
tp_decode        tensor-parallel decode (cudabook.tensor_parallel.ParallelDecoder) against one GPU,
                 both captured in CUDA graphs
tp_train         tensor parallelism (cudabook.tensor_parallel) at GPT-2-small shapes against one
                 GPU and torch's parallelize_module
allreduce_sweep and ddp_train import only torch; sharded_train, tp_decode and tp_train import the
book's engines (cudabook.sharded, cudabook.tensor_parallel), which import no CUDA library of their
own.
"""
