"""CUDA graphs: capture the launches made on a stream, instantiate, replay, update kernel-node parameters.

    stream = kvattn.Stream()                       # a created stream: the legacy stream cannot capture
    with kvattn.graphs.capture(stream) as cap:
        w.run(q, k_cache, v_cache, out=o, stream=stream)   # launches are recorded, not run
    g = cap.graph
    g.replay(stream)                               # runs them; host cost of one launch call
"""
from __future__ import annotations

import contextlib
import weakref

from . import _driver
from .kernels import ParamBuffer
from .stream import as_stream, require_capturable


class Graph:
    """An instantiated graph (CUgraphExec) and the graph it came from."""

    def __init__(self, graph):
        self.graph = graph
        self.exec = _driver.call("cuGraphInstantiate", graph, 0)
        self._finalizer = weakref.finalize(self, _destroy, graph, self.exec)
        self._kernel_nodes = None

    def replay(self, stream=None):
        _driver.call("cuGraphLaunch", self.exec, as_stream(stream).handle)

    def kernel_nodes(self) -> list:
        """The graph's kernel nodes, in capture order (the order of a topological walk)."""
        if self._kernel_nodes is None:
            drv = _driver.driver()
            nodes, n = _driver.call("cuGraphGetNodes", self.graph, 0)
            nodes, n = _driver.call("cuGraphGetNodes", self.graph, n)
            kern = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
            self._kernel_nodes = [x for x in nodes[:n] if _driver.call("cuGraphNodeGetType", x) == kern]
        return self._kernel_nodes

    def update_kernel_params(self, index: int, params: ParamBuffer, grid=None):
        """Give kernel node `index` a new parameter struct (and optionally grid) without re-instantiating."""
        node = self.kernel_nodes()[index]
        kp = _driver.call("cuGraphKernelNodeGetParams", node)
        kp.kernelParams = params.argv_addr
        if grid is not None:
            gx, gy, gz = grid if isinstance(grid, tuple) else (grid, 1, 1)
            kp.gridDimX, kp.gridDimY, kp.gridDimZ = gx, gy, gz
        _driver.call("cuGraphExecKernelNodeSetParams", self.exec, node, kp)
        _driver.call("cuGraphKernelNodeSetParams", node, kp)


def _destroy(graph, exec_):
    drv = _driver.driver()
    try:
        drv.cuGraphExecDestroy(exec_)
        drv.cuGraphDestroy(graph)
    except Exception:
        pass


class _Capture:
    graph: Graph | None = None


@contextlib.contextmanager
def capture(stream):
    """Record every launch issued on `stream` inside the block into a Graph. The stream must be an explicit
    created stream (kvattn.Stream(), a torch / CuPy stream): the legacy default stream cannot capture. Pass that
    stream to every run() inside the block, with out (and lse) given."""
    s = as_stream(stream)
    require_capturable(s)
    drv = _driver.driver()
    cap = _Capture()
    _driver.call("cuStreamBeginCapture", s.handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    try:
        yield cap
    except BaseException:
        try:
            g = _driver.call("cuStreamEndCapture", s.handle)
            drv.cuGraphDestroy(g)
        except Exception:
            pass
        raise
    g = _driver.call("cuStreamEndCapture", s.handle)
    cap.graph = Graph(g)
