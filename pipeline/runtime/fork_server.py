"""The first module multiprocessing's fork server imports (lifetime.children_context): it blocks the
stop signals there. A Ctrl-C, SIGTERM or hangup sent to the whole process group then cannot end the server
(the driver would take every child it forked for dead), and the children it forks start with them
blocked, as a child's mask is its parent's, until `child_started` ignores them."""
import signal

from pipeline.runtime.lifetime import STOP_SIGNALS

signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
