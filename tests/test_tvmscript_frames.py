"""schedules/tvmscript_frames.py: T.prim_func's frames taken without inspect.findsource, TVMScript
parsing as before."""
import inspect
import os

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import tirx as T

from tvm_qconv.schedules import tvmscript_frames


def test_the_frames_and_lines_are_inspect_stacks():
    # what TVM's prim_func reads: each frame and, for every file on disk, its one source line
    def caller():     # both lists start at this frame
        return tvmscript_frames.stack_with_cached_lines(), inspect.stack()
    ours, theirs = caller()
    assert [f.frame for f in ours] == [f.frame for f in theirs]
    on_disk = [i for i, f in enumerate(theirs) if os.path.exists(f.filename)]
    assert len(on_disk) > 3 and ours[0].code_context == theirs[0].code_context
    assert [ours[i][1:5] for i in on_disk] == [theirs[i][1:5] for i in on_disk]   # file, line, function, its text


def test_installed_for_prim_func_and_an_ir_module_class_still_parses():
    # install() runs with the schedules' import; a prim_func inside an @I.ir_module class is left
    # to the class (is_defined_in_class reads the third frame's line), a closure's variables resolve
    from tvm.tirx.script.parser import entry
    assert entry.inspect.stack is tvmscript_frames.stack_with_cached_lines
    assert entry.inspect.isfunction is inspect.isfunction       # the rest of inspect unchanged
    n = 8

    @I.ir_module
    class Module:
        @T.prim_func
        def add_one(a: T.Buffer((8,), "int32"), b: T.Buffer((8,), "int32")):
            for i in range(8):
                b[i] = a[i] + 1

    @T.prim_func
    def closure(a: T.Buffer((n,), "int32"), b: T.Buffer((n,), "int32")):
        for i in range(n):
            b[i] = a[i] * 2

    assert isinstance(Module, tvm.IRModule) and [gv.name_hint for gv in Module.get_global_vars()] == ["add_one"]
    a = np.arange(8, dtype=np.int32)
    for func, want in ((Module["add_one"], a + 1), (closure, a * 2)):
        out = tvm.runtime.tensor(np.zeros(8, np.int32))
        tvm.compile(func, target="llvm")(tvm.runtime.tensor(a), out)
        np.testing.assert_array_equal(out.numpy(), want)
