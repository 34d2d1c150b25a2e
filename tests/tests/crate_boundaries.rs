//! The planner crate stays without Burn: `merak-plan` depends on none of Burn, CubeCL, MPI,
//! NCCL or the library, so it compiles beside them and a planning tool can use it alone.

use std::path::Path;

/// The dependencies `merak-plan` must not have: a name equal to one of these or starting with
/// one followed by `-` (`burn-flex`, `cubecl-cuda`).
const FORBIDDEN: [&str; 7] = [
    "burn",
    "cubecl",
    "cubek",
    "mpi",
    "cudarc",
    "wgpu",
    "merak-burn",
];

/// The dependency names of a manifest's `[dependencies]`, `[dev-dependencies]` and
/// `[build-dependencies]` tables.
fn dependencies(manifest: &str) -> Vec<String> {
    let value: toml::Table = toml::from_str(manifest).expect("a valid Cargo.toml");
    ["dependencies", "dev-dependencies", "build-dependencies"]
        .iter()
        .filter_map(|t| value.get(*t).and_then(|d| d.as_table()))
        .flat_map(|t| t.keys().cloned())
        .collect()
}

/// The names of `deps` that are forbidden.
fn forbidden(deps: &[String]) -> Vec<String> {
    deps.iter()
        .filter(|d| {
            FORBIDDEN
                .iter()
                .any(|f| d.as_str() == *f || d.starts_with(&format!("{f}-")))
        })
        .cloned()
        .collect()
}

#[test]
fn the_planner_crate_depends_on_no_burn() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../merak-plan/Cargo.toml");
    let manifest = std::fs::read_to_string(&path).expect("merak-plan/Cargo.toml");
    let deps = dependencies(&manifest);
    assert!(
        deps.iter().any(|d| d == "serde"),
        "read no dependencies: {deps:?}"
    );
    assert_eq!(
        forbidden(&deps),
        Vec::<String>::new(),
        "merak-plan depends on them"
    );
}

#[test]
fn the_check_finds_a_burn_dependency() {
    let manifest = "[dependencies]\nserde = \"1\"\nburn-flex = \"0.21\"\n\n\
                    [dev-dependencies]\nmerak-burn = { path = \"../merak-burn\" }\n";
    let deps = dependencies(manifest);
    assert_eq!(forbidden(&deps), ["burn-flex", "merak-burn"]);
    assert!(forbidden(&["burnish".to_string()]).is_empty());
}
