"""GPU machine: can cuFile register an O_DIRECT fd here, by file system and compat setting? Prints one line per try."""
import os
import sys
import tempfile

from kmesh.storage import cufile

lib = cufile.load_lib()
lib.driver_open()
print("mode", cufile.detect(lib), flush=True)
for d in (os.getcwd(), "/tmp", "/dev/shm", os.path.expanduser("~")):
    try:
        fd_path = tempfile.NamedTemporaryFile(dir=d, delete=False)
        fd_path.write(b"\0" * 8192); fd_path.close()
        fs = os.popen(f"stat -f -c %T {d}").read().strip()
        fd = os.open(fd_path.name, os.O_RDONLY | os.O_DIRECT)
        try:
            h = cufile.CuFileHandle(lib, fd)
            print(d, fs, "registered", flush=True)
            h.close()
        except Exception as e:
            print(d, fs, "FAILED", e, flush=True)
        os.close(fd); os.unlink(fd_path.name)
    except Exception as e:
        print(d, "setup failed", e)
