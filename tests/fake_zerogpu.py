"""A stand-in for `spaces.GPU` (Hugging Face ZeroGPU) with what matters off a Space: the decorated function runs in
a forked worker process and its arguments, its return value and (a generator's) every yield travel pickled through
multiprocessing queues, as in `spaces.zero.wrappers` (spaces 0.51). An exception in the worker reaches the caller
as its class name only, as there ("ZeroGPU worker error"). So anything that only works in one process fails here
as it would on a Space; a worker that hangs fails the call after `timeout` seconds instead of hanging the tests."""
import inspect
import multiprocessing
import queue

_FORK = multiprocessing.get_context("fork")


class ZeroGPUWorkerError(RuntimeError):
    pass


def GPU(duration: int = 60, timeout: float = 120):
    def decorate(fn):
        if inspect.isgeneratorfunction(fn):
            def handler(*args, **kwargs):
                yield from _call(fn, args, kwargs, True, timeout)
        else:
            def handler(*args, **kwargs):
                return next(_call(fn, args, kwargs, False, timeout))
        return handler
    return decorate


def _worker(fn, arg_queue, res_queue, generator):
    args, kwargs = arg_queue.get()
    try:
        if generator:
            for item in fn(*args, **kwargs):
                res_queue.put(("ok", item))
        else:
            res_queue.put(("ok", fn(*args, **kwargs)))
    except Exception as e:
        res_queue.put(("error", type(e).__name__))
    res_queue.put(("end", None))


def _call(fn, args, kwargs, generator, timeout):
    arg_queue, res_queue = _FORK.SimpleQueue(), _FORK.Queue()
    process = _FORK.Process(target=_worker, args=(fn, arg_queue, res_queue, generator), daemon=True)
    process.start()   # fn travels by fork, as spaces' task does; the arguments are pickled
    try:
        arg_queue.put((args, kwargs))
        while True:
            try:
                kind, value = res_queue.get(timeout=timeout)
            except queue.Empty:
                raise ZeroGPUWorkerError(f"the worker process sent nothing for {timeout} s (hung?)") from None
            if kind == "end":
                return
            if kind == "error":
                raise ZeroGPUWorkerError(f"ZeroGPU worker error: {value}")
            yield value
    finally:
        process.join(timeout=1)
        if process.is_alive():
            process.terminate()
