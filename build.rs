//! Lets every binary, test and bench find libtorch at run time without LD_LIBRARY_PATH: torch-sys
//! (`links = "tch"`) exports its library folder as DEP_TCH_LIBTORCH_LIB; we add it as an rpath.
//! Also compiles the caching CPU allocator (src/model/cpu_allocator.cpp, see
//! `nextstate::model::cpu_allocator`) against the headers next to that library folder, with the C++
//! ABI torch-sys uses (`LIBTORCH_CXX11_ABI`, default 1).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=src/model/cpu_allocator.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB").or_else(|_| std::env::var("LIBTORCH").map(|l| format!("{l}/lib"))).unwrap_or_else(|_| {
        panic!("neither DEP_TCH_LIBTORCH_LIB (from torch-sys) nor LIBTORCH names libtorch's folder; see ../shared/docs/BUILD.md")
    });
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    // On a CUDA libtorch, `--as-needed` would drop libtorch_cuda (no symbol of it is referenced)
    // and tch::Cuda::is_available() would say false: link it explicitly (../shared/docs/BUILD.md).
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
    // torch-sys's split layout (LIBTORCH_INCLUDE) first, else the `include` folder beside `lib`.
    println!("cargo:rerun-if-env-changed=LIBTORCH_INCLUDE");
    let include = match std::env::var("LIBTORCH_INCLUDE") {
        Ok(dir) => std::path::Path::new(&dir).join("include"),
        Err(_) => std::path::Path::new(&lib).parent().map(|p| p.join("include")).expect("libtorch lib folder has a parent"),
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .include(&include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .file("src/model/cpu_allocator.cpp")
        .compile("nextstate_cpu_allocator");
    println!("cargo:rustc-link-lib=c10");
}
