//! Build script. Without feature `torch` it does nothing: the core needs no C++.
//! With it, it asks `$PYTHON` (default `python3`) where torch is, compiles the cxx bridge and
//! `cpp/shim.cc` against torch's headers (C++17 below torch 2.12, C++20 from 2.12, torch's
//! cxx11 ABI), and links c10 and torch_cpu.

#[cfg(feature = "torch")]
use std::process::Command;

#[cfg(feature = "torch")]
const PROBE: &str = "import torch, torch.utils.cpp_extension as ce\n\
print(torch.__version__)\n\
print(';'.join(ce.include_paths()))\n\
print(ce.library_paths()[0])\n\
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))\n\
import sysconfig\n\
print(sysconfig.get_paths()['include'])";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PYTHON");
    #[cfg(feature = "torch")]
    if let Err(msg) = build_torch_shim() {
        eprintln!("error: {msg}");
        panic!("sched-lifetime: {msg}");
    }
}

#[cfg(feature = "torch")]
struct Torch {
    version: (u32, u32),
    includes: Vec<String>,
    libdir: String,
    cxx11_abi: bool,
    /// Python.h's folder: `cpp/direct.cc` (the eager hot path's entry) uses the stable ABI only.
    python_include: String,
}

#[cfg(feature = "torch")]
fn probe(python: &str) -> Result<Torch, String> {
    let out = Command::new(python)
        .args(["-c", PROBE])
        .output()
        .map_err(|e| format!("feature `torch` needs torch: could not run PYTHON={python}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "feature `torch` needs torch: PYTHON={python} could not import it ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let lines: Vec<&str> = stdout.lines().collect();
    let bad = || format!("feature `torch`: PYTHON={python} answered the torch probe with {stdout:?}");
    if lines.len() < 5 {
        return Err(bad());
    }
    let mut v = lines[0].split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty());
    let major = v.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let minor = v.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    if (major, minor) < (2, 4) {
        return Err(format!("feature `torch` needs torch >= 2.4; PYTHON={python} has {}", lines[0]));
    }
    Ok(Torch {
        version: (major, minor),
        includes: lines[1].split(';').map(String::from).collect(),
        libdir: lines[2].to_string(),
        cxx11_abi: lines[3].trim() == "1",
        python_include: lines[4].to_string(),
    })
}

#[cfg(feature = "torch")]
fn build_torch_shim() -> Result<(), String> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let torch = probe(&python)?;
    let std = if torch.version >= (2, 12) { "c++20" } else { "c++17" };
    let mut build = cxx_build::bridge("src/ffi/bridge.rs");
    build
        .file("cpp/shim.cc")
        .file("cpp/direct.cc")
        .std(std)
        .define("_GLIBCXX_USE_CXX11_ABI", if torch.cxx11_abi { "1" } else { "0" })
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .warnings(false);
    for inc in &torch.includes {
        build.include(inc);
    }
    if !std::path::Path::new(&torch.python_include).join("Python.h").exists() {
        return Err(format!(
            "feature `torch` needs Python's headers (Python.h) for cpp/direct.cc: not in {} (PYTHON={python}); \
             install the Python development package",
            torch.python_include
        ));
    }
    build.include(&torch.python_include);
    build.compile("sched_lifetime_shim");
    for f in ["cpp/shim.cc", "cpp/direct.cc", "cpp/shim.h", "src/ffi/bridge.rs"] {
        println!("cargo:rerun-if-changed={f}");
    }
    // Another torch behind the same $PYTHON (pip upgraded it in place) must rebuild the shim
    // against its headers: cargo reruns this script when torch's libraries change.
    for lib in ["libc10.so", "libtorch_cpu.so"] {
        println!("cargo:rerun-if-changed={}", std::path::Path::new(&torch.libdir).join(lib).display());
    }
    println!("cargo:rustc-link-search=native={}", torch.libdir);
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    // Test binaries find torch here; a loaded extension finds the already-loaded libraries.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", torch.libdir);
    Ok(())
}
