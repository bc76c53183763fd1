//! Lets every binary, test and bench find libtorch at run time without LD_LIBRARY_PATH: torch-sys
//! (`links = "tch"`) exports its library folder as DEP_TCH_LIBTORCH_LIB; we add it as an rpath.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        // On a CUDA libtorch, `--as-needed` would drop libtorch_cuda (no symbol of it is referenced)
        // and tch::Cuda::is_available() would say false: link it explicitly (../shared/docs/BUILD.md).
        if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
    }
}
