//! The Python module `sched_lifetime._direct` (cpp/direct.cc): the eager hot path's bind /
//! retire / acquire without the torch.ops round trip. Its functions call the same entry points
//! as the ops (`lifetime_ops`); this file only exports the module's init symbol, because a
//! cdylib exports Rust's `no_mangle` functions and not those of the C++ objects it links.

use std::ffi::c_void;

extern "C" {
    fn sched_lifetime_direct_module_init() -> *mut c_void;
}

/// CPython's init hook for `sched_lifetime._direct` (loaded from this same library file by
/// `torch_ops/sched_lifetime/_ops.py`). Returns the module, or null with a Python error set.
#[no_mangle]
#[allow(non_snake_case)]
pub extern "C" fn PyInit__direct() -> *mut c_void {
    // SAFETY: called by CPython's import machinery with the GIL held, as the hook requires.
    unsafe { sched_lifetime_direct_module_init() }
}
