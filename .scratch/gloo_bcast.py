import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
MB = 1 << 20
def run(rank, world, port, size_mb, mode, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.empty(size_mb * MB, dtype=torch.uint8)
    if rank == 0: t.fill_(7)
    dist.barrier()
    times = []
    for _ in range(3):
        dist.barrier(); s = time.perf_counter()
        if mode == "bcast":
            dist.broadcast(t, 0)
        elif mode == "chunks":
            works = [dist.broadcast(c, 0, async_op=True) for c in t.chunk(16)]
            for w in works: w.wait()
        elif mode == "scatter_allgather":
            n = t.numel() // world
            parts = list(t[: n * world].view(world, n))
            mine = torch.empty(n, dtype=torch.uint8)
            dist.scatter(mine, parts if rank == 0 else None, src=0)
            dist.all_gather_into_tensor(t[: n * world], mine) if hasattr(dist, "all_gather_into_tensor") and False else dist.all_gather(list(t[: n*world].view(world, n)), mine)
        dist.barrier(); times.append(time.perf_counter() - s)
    assert int(t[-(t.numel()//world*world)].item() if False else t[0].item()) == 7
    if rank == 0: q.put(min(times))
    dist.destroy_process_group()
if __name__ == "__main__":
    size = int(sys.argv[1])
    for world in (2, 5):
        for mode in ("bcast", "chunks", "scatter_allgather"):
            q = mp.get_context("spawn").SimpleQueue()
            port = 29500 + world * 10 + ["bcast", "chunks", "scatter_allgather"].index(mode)
            mp.spawn(run, args=(world, port, size, mode, q), nprocs=world)
            print(world, mode, f"{q.get():.3f}s", flush=True)
