"""The raw floor of NCCL point-to-point from Python, beside torch.distributed's, on two GPUs.

``python benchmarks/gpu/nccl_api_floor.py`` (a machine with two GPUs; torch's CUDA build
brings libnccl.so.2)

Two processes (cuda:0 and cuda:1) join one torch.distributed NCCL group and, through
``ctypes``, one NCCL communicator of their own (the unique id passed over a queue).
Each prints, per mode: a stream of 400 x 1 MiB and 30 x 64 MiB sends (rank 0) and
receives (rank 1), time per message until the device is synchronized, through
``dist.send`` / ``dist.recv`` ("torch") and through ``ncclSend`` / ``ncclRecv`` on one
stream ("ctypes"), each run twice alternating (the second printed); and a 4 KiB ping-pong's one-way p50 (200
exchanges after 5 warm-ups). Nothing of omnilink: the floor its nccl connector is
measured against (2x H200, 2026-11-27: 1 MiB 13 us/message through the C API, 43
through the process group).
"""
import ctypes, glob, os, sys, time, statistics
import multiprocessing as mp

def find_lib():
    import torch
    for p in sys.path:
        for f in glob.glob(os.path.join(p, "nvidia", "nccl", "lib", "libnccl.so*")):
            return f
    for line in open("/proc/self/maps"):
        if "libnccl" in line:
            return line.split()[-1]
    return "libnccl.so.2"

class UID(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]

def worker(rank, q_in, q_out, port):
    import torch, torch.distributed as dist
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    lib = ctypes.CDLL(find_lib())
    ver = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(ver))
    uid = UID()
    if rank == 0:
        assert lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
        for _ in range(1): q_out.put(bytes(uid.internal))
    else:
        raw = q_in.get()
        ctypes.memmove(ctypes.byref(uid), raw, 128)
    comm = ctypes.c_void_p()
    t0 = time.perf_counter()
    r = lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank)
    assert r == 0, r
    init_s = time.perf_counter() - t0
    lib.ncclSend.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.ncclRecv.argtypes = lib.ncclSend.argtypes
    stream = torch.cuda.Stream(dev)
    sraw = ctypes.c_void_p(int(stream.cuda_stream))
    res = {"rank": rank, "nccl": ver.value, "lib": find_lib(), "init_s": init_s}
    for nbytes, n in ((1 << 20, 400), (64 << 20, 30)):
        buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        for mode in ("torch", "ctypes", "torch", "ctypes"):
            dist.barrier(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                if mode == "torch":
                    if rank == 0: dist.send(buf, 1)
                    else: dist.recv(buf, 0)
                else:
                    if rank == 0: lib.ncclSend(buf.data_ptr(), nbytes, 0, 1, comm, sraw)
                    else: lib.ncclRecv(buf.data_ptr(), nbytes, 0, 0, comm, sraw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            res[f"{mode} {nbytes>>20}MiB"] = f"{dt/n*1e6:.1f} us/msg {nbytes*n/dt/1e9:.1f} GB/s"
        # per-call host cost
    buf = torch.ones(4096, dtype=torch.uint8, device=dev)
    for mode in ("torch", "ctypes", "torch", "ctypes"):
        lat = []
        for i in range(205):
            dist.barrier() if mode == "torch" and i % 50 == 0 else None
            t0 = time.perf_counter()
            if mode == "torch":
                if rank == 0:
                    dist.send(buf, 1); dist.recv(buf, 1); torch.cuda.synchronize()
                else:
                    dist.recv(buf, 0); torch.cuda.synchronize(); dist.send(buf, 0)
            else:
                if rank == 0:
                    lib.ncclSend(buf.data_ptr(), 4096, 0, 1, comm, sraw); lib.ncclRecv(buf.data_ptr(), 4096, 0, 1, comm, sraw); stream.synchronize()
                else:
                    lib.ncclRecv(buf.data_ptr(), 4096, 0, 0, comm, sraw); stream.synchronize(); lib.ncclSend(buf.data_ptr(), 4096, 0, 0, comm, sraw)
            if i >= 5: lat.append((time.perf_counter() - t0) / 2 * 1e6)
        res[f"4KiB pp {mode}"] = f"p50 {statistics.median(lat):.1f} us"
        torch.cuda.synchronize()
    # host cost of one call (no sync): enqueue 50 sends vs recvs
    print(res, flush=True)
    lib.ncclCommDestroy(comm)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(0, None, q, port)), ctx.Process(target=worker, args=(1, q, None, port))]
    for p in ps: p.start()
    for p in ps: p.join(120)
