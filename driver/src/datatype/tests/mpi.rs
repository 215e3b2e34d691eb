//! Cross-check with MPI: a C program built with `mpicc` builds the same
//! types with MPI's constructors, packs a buffer with `MPI_Pack` and
//! prints the bytes and the type's bounds; our patterns must name the
//! same bytes in the same order. The program is compiled with every MPI
//! compiler found (`$MPICC` or `mpicc`, and Debian's `mpicc.openmpi` and
//! `mpicc.mpich`).
//!
//! The types are random (a fixed seed) from the property tests' strategy,
//! kept to what MPI implementations agree on: basic elements at offsets
//! that are multiples of their alignment (Open MPI and MPICH pad the
//! extents of types with misaligned elements each its own way), no
//! component without data
//! (Open MPI and MPICH bound empty struct fields, the standard's typemap
//! has nothing there), no negative extents, and no struct mixing fields
//! with explicit bounds and fields without (MPICH takes the natural
//! bounds of the others too; the standard and Open MPI take only the
//! markers), and no type without explicit bounds whose extent is not a
//! multiple of its alignment (Open MPI rounds the extent of every derived
//! type up to it; the standard and MPICH, like us, round only structs'),
//! and no vector with a negative stride whose blocks touch or overlap
//! (Open MPI takes `vector(3, 1, -1)` of bytes for three contiguous
//! bytes from 0; they are at 0, -1 and -2, as MPICH has them).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

use super::props::datatype;
use crate::datatype::{Constructor, Datatype, Order};

/// Cases in the program.
const CASES: usize = 300;

/// Time the program may take (it takes well under a second).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// The byte at buffer offset `i`: a hash, so that bytes out of order
/// show.
fn fill(i: usize) -> u8 {
    ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

fn mpi_agrees_on(t: &Datatype) -> bool {
    let bounds = t.bounds();
    if t.size() == 0 || (!bounds.marked && t.extent() % bounds.align as i64 != 0) {
        return false;
    }
    // Every basic element aligned.
    let aligned = t.groups().unwrap().iter().all(|group| {
        let align = group.element.bounds().align as i64;
        group.displacement % align == 0
            && group.loops.iter().all(|&(_, stride)| stride % align == 0)
    });
    if !aligned {
        return false;
    }
    let reversed_runs = match t.constructor() {
        Constructor::Vector { stride, block, .. } => *stride < 0 && -stride <= *block as i64,
        Constructor::Hvector {
            stride,
            block,
            inner,
            ..
        } => *stride < 0 && -stride <= *block as i64 * inner.extent(),
        _ => false,
    };
    if reversed_runs {
        return false;
    }
    let children: Vec<&Datatype> = match t.constructor() {
        Constructor::Primitive { .. } => return true,
        Constructor::Contiguous { inner, .. }
        | Constructor::Vector { inner, .. }
        | Constructor::Hvector { inner, .. }
        | Constructor::Indexed { inner, .. }
        | Constructor::Hindexed { inner, .. }
        | Constructor::IndexedBlock { inner, .. }
        | Constructor::HindexedBlock { inner, .. }
        | Constructor::Subarray { inner, .. }
        | Constructor::Resized { inner, .. } => vec![inner],
        Constructor::Struct { fields } => {
            let live: Vec<_> = fields.iter().filter(|f| f.block > 0).collect();
            let marked: BTreeSet<bool> = live.iter().map(|f| f.datatype.bounds().marked).collect();
            if marked.len() > 1 {
                return false;
            }
            fields.iter().map(|f| &f.datatype).collect()
        }
    };
    children.into_iter().all(mpi_agrees_on)
}

/// Appends C code building `t`; returns the variable holding it.
fn build_c(t: &Datatype, code: &mut String, next: &mut usize) -> String {
    let name = format!("t{next}");
    *next += 1;
    let list = |values: &mut dyn Iterator<Item = String>| values.collect::<Vec<_>>().join(", ");
    match t.constructor() {
        Constructor::Primitive { size, align } => {
            let named = match (size, align) {
                (1, 1) => Some("MPI_BYTE"),
                (2, 2) => Some("MPI_SHORT"),
                (4, 4) => Some("MPI_INT"),
                (8, 8) => Some("MPI_DOUBLE"),
                (_, 1) => None,
                other => panic!("no MPI basic type for {other:?}"),
            };
            match named {
                Some(named) => writeln!(code, "MPI_Datatype {name} = {named};").unwrap(),
                None => writeln!(
                    code,
                    "MPI_Datatype {name}; MPI_Type_contiguous({size}, MPI_BYTE, &{name});"
                )
                .unwrap(),
            }
        }
        Constructor::Contiguous { count, inner } => {
            let inner = build_c(inner, code, next);
            writeln!(
                code,
                "MPI_Datatype {name}; MPI_Type_contiguous({count}, {inner}, &{name});"
            )
            .unwrap();
        }
        Constructor::Vector {
            count,
            block,
            stride,
            inner,
        }
        | Constructor::Hvector {
            count,
            block,
            stride,
            inner,
        } => {
            let call = match t.constructor() {
                Constructor::Vector { .. } => "MPI_Type_vector",
                _ => "MPI_Type_create_hvector",
            };
            let inner = build_c(inner, code, next);
            writeln!(
                code,
                "MPI_Datatype {name}; {call}({count}, {block}, {stride}, {inner}, &{name});"
            )
            .unwrap();
        }
        Constructor::Indexed { blocks, inner } | Constructor::Hindexed { blocks, inner } => {
            let bytes = matches!(t.constructor(), Constructor::Hindexed { .. });
            let inner = build_c(inner, code, next);
            let lens = list(&mut blocks.iter().map(|b| b.0.to_string()));
            let disps = list(&mut blocks.iter().map(|b| b.1.to_string()));
            let (kind, call) = if bytes {
                ("MPI_Aint", "MPI_Type_create_hindexed")
            } else {
                ("int", "MPI_Type_indexed")
            };
            writeln!(
                code,
                "MPI_Datatype {name}; {{ int l[] = {{{lens}}}; {kind} d[] = {{{disps}}}; \
                 {call}({}, l, d, {inner}, &{name}); }}",
                blocks.len()
            )
            .unwrap();
        }
        Constructor::IndexedBlock {
            block,
            displacements,
            inner,
        }
        | Constructor::HindexedBlock {
            block,
            displacements,
            inner,
        } => {
            let bytes = matches!(t.constructor(), Constructor::HindexedBlock { .. });
            let inner = build_c(inner, code, next);
            let disps = list(&mut displacements.iter().map(|d| d.to_string()));
            let (kind, call) = if bytes {
                ("MPI_Aint", "MPI_Type_create_hindexed_block")
            } else {
                ("int", "MPI_Type_create_indexed_block")
            };
            writeln!(
                code,
                "MPI_Datatype {name}; {{ {kind} d[] = {{{disps}}}; \
                 {call}({}, {block}, d, {inner}, &{name}); }}",
                displacements.len()
            )
            .unwrap();
        }
        Constructor::Struct { fields } => {
            let types: Vec<String> = fields
                .iter()
                .map(|f| build_c(&f.datatype, code, next))
                .collect();
            let lens = list(&mut fields.iter().map(|f| f.block.to_string()));
            let disps = list(&mut fields.iter().map(|f| f.displacement.to_string()));
            writeln!(
                code,
                "MPI_Datatype {name}; {{ int l[] = {{{lens}}}; MPI_Aint d[] = {{{disps}}}; \
                 MPI_Datatype t[] = {{{}}}; MPI_Type_create_struct({}, l, d, t, &{name}); }}",
                types.join(", "),
                fields.len()
            )
            .unwrap();
        }
        Constructor::Subarray {
            sizes,
            subsizes,
            starts,
            order,
            inner,
        } => {
            let inner = build_c(inner, code, next);
            let order = match order {
                Order::C => "MPI_ORDER_C",
                Order::Fortran => "MPI_ORDER_FORTRAN",
            };
            let ints = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
            writeln!(
                code,
                "MPI_Datatype {name}; {{ int s[] = {{{}}}; int u[] = {{{}}}; int b[] = {{{}}}; \
                 MPI_Type_create_subarray({}, s, u, b, {order}, {inner}, &{name}); }}",
                ints(sizes),
                ints(subsizes),
                ints(starts),
                sizes.len()
            )
            .unwrap();
        }
        Constructor::Resized { lb, extent, inner } => {
            let inner = build_c(inner, code, next);
            writeln!(
                code,
                "MPI_Datatype {name}; MPI_Type_create_resized({inner}, {lb}, {extent}, &{name});"
            )
            .unwrap();
        }
    }
    name
}

struct Case {
    datatype: Datatype,
    count: u64,
    /// Where the base lies in the buffer.
    base: usize,
}

/// Where `program` is: itself when it names a path, else the first
/// match on `PATH`.
fn locate(program: &str) -> Option<std::path::PathBuf> {
    if program.contains('/') {
        return Some(Path::new(program).to_path_buf()).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// The MPI compilers on this machine (none when `mpicc` is missing).
fn compilers() -> Vec<String> {
    let chosen = std::env::var("MPICC").ok();
    if let Some(chosen) = &chosen {
        assert!(locate(chosen).is_some(), "MPICC={chosen} is not there");
    }
    let first = chosen.unwrap_or_else(|| "mpicc".into());
    let mut found: Vec<String> = Vec::new();
    let mut seen = BTreeSet::new();
    for candidate in [first.as_str(), "mpicc.openmpi", "mpicc.mpich"] {
        let Some(path) = locate(candidate) else {
            continue;
        };
        // `mpicc` is usually a link to one of the others.
        if seen.insert(std::fs::canonicalize(&path).unwrap_or(path)) {
            found.push(candidate.to_owned());
        }
    }
    found
}

#[test]
#[cfg_attr(
    pindown_no_mpicc,
    ignore = "no mpicc on PATH (install Debian's mpich or openmpi-bin with libopenmpi-dev, or set MPICC); under CI=true this test runs and fails instead"
)]
fn patterns_pack_the_same_bytes_as_mpi_pack() {
    let compilers = compilers();
    assert!(
        !compilers.is_empty(),
        "no MPI compiler runs (mpicc or $MPICC; Debian: mpich or libopenmpi-dev)"
    );
    let mut runner = TestRunner::deterministic();
    let strategy = datatype(false);
    let mut cases = Vec::new();
    let mut span = 0usize;
    while cases.len() < CASES {
        let datatype = strategy.new_tree(&mut runner).unwrap().current();
        let count = 1 + (cases.len() % 3) as u64;
        if !mpi_agrees_on(&datatype) || datatype.size() * count > 1 << 14 {
            continue;
        }
        let pattern = datatype.commit().unwrap().pattern(count).unwrap();
        let (low, high) = pattern.plan().unwrap().hull().unwrap();
        if high - low > 1 << 16 {
            continue;
        }
        let base = (16 - low).max(0) as usize;
        span = span.max((base as i64 + high) as usize + 16);
        cases.push(Case {
            datatype,
            count,
            base,
        });
    }

    let mut program = String::from(
        "#include <mpi.h>\n#include <stdio.h>\n#include <stdlib.h>\n\
         static unsigned char *buf;\n\
         static void emit(int id, MPI_Datatype t, int count, long base) {\n\
         MPI_Type_commit(&t);\n\
         int room; MPI_Pack_size(count, t, MPI_COMM_WORLD, &room);\n\
         unsigned char *out = malloc(room + 1); int at = 0;\n\
         if (MPI_Pack(buf + base, count, t, out, room, &at, MPI_COMM_WORLD) != MPI_SUCCESS) abort();\n\
         MPI_Aint lb, extent, true_lb, true_extent; int size;\n\
         MPI_Type_get_extent(t, &lb, &extent); MPI_Type_get_true_extent(t, &true_lb, &true_extent);\n\
         MPI_Type_size(t, &size);\n\
         printf(\"%d %ld %ld %ld %ld %d \", id, (long)lb, (long)extent, (long)true_lb, (long)true_extent, size);\n\
         for (int i = 0; i < at; i++) printf(\"%02x\", out[i]);\n\
         printf(\"\\n\"); free(out);\n}\n",
    );
    writeln!(
        program,
        "int main(int argc, char **argv) {{\nMPI_Init(&argc, &argv);"
    )
    .unwrap();
    writeln!(program, "buf = malloc({span});").unwrap();
    writeln!(
        program,
        "for (unsigned long i = 0; i < {span}; i++) buf[i] = (unsigned char)((i * 0x9e3779b97f4a7c15ul) >> 56);"
    )
    .unwrap();
    for (id, case) in cases.iter().enumerate() {
        let mut next = 0;
        let mut code = String::new();
        let top = build_c(&case.datatype, &mut code, &mut next);
        writeln!(
            program,
            "{{\n{code}emit({id}, {top}, {}, {});\n}}",
            case.count, case.base
        )
        .unwrap();
    }
    program.push_str("MPI_Finalize();\nreturn 0;\n}\n");

    let dir = std::env::temp_dir().join(format!("pindown-mpi-pack-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("pack.c");
    std::fs::write(&source, &program).unwrap();
    let mut failures = Vec::new();
    for compiler in &compilers {
        failures.extend(check_with(compiler, &dir, &source, &cases));
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        failures.is_empty(),
        "{} disagreements with MPI_Pack, the first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(4)]
    );
}

/// Runs the program built by `compiler`; returns the disagreements.
fn check_with(compiler: &str, dir: &Path, source: &Path, cases: &[Case]) -> Vec<String> {
    let mut failures = Vec::new();
    let compiler_name = compiler.replace('/', "_");
    let binary = dir.join(format!("pack-{compiler_name}"));
    let built = Command::new(compiler)
        .arg("-O1")
        .arg("-o")
        .arg(&binary)
        .arg(source)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{compiler} failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    // A singleton run (no mpiexec); Open MPI refuses root without these.
    // Output to files (a full pipe would stall the program) and a time
    // limit (an MPI start-up that hangs fails the test).
    let (out_path, err_path) = (
        dir.join(format!("{compiler_name}.out")),
        dir.join(format!("{compiler_name}.err")),
    );
    let mut child = Command::new(&binary)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > RUN_LIMIT {
            child.kill().ok();
            child.wait().ok();
            panic!("the {compiler} program ran longer than {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.success(),
        "the {compiler} program failed ({status}): {}",
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), cases.len(), "{compiler}: one line per case");
    for (line, (id, case)) in lines.iter().zip(cases.iter().enumerate()) {
        let fields: Vec<&str> = line.split(' ').collect();
        let number = |i: usize| fields[i].parse::<i64>().unwrap();
        let t = &case.datatype;
        assert_eq!(number(0), id as i64);
        let ours = (
            t.lb(),
            t.extent(),
            t.true_lb(),
            t.true_extent(),
            t.size() as i64,
        );
        let theirs = (number(1), number(2), number(3), number(4), number(5));
        if ours != theirs {
            failures.push(format!(
                "{compiler}: case {id}: (lb, extent, true lb, true extent, size) ours {ours:?}, MPI's {theirs:?}: {t:?}"
            ));
            continue;
        }
        let packed: Vec<u8> = (0..fields.get(6).map_or(0, |hex| hex.len()) / 2)
            .map(|i| u8::from_str_radix(&fields[6][2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let pattern = t.commit().unwrap().pattern(case.count).unwrap();
        let mut expected = Vec::new();
        for segment in pattern.plan().unwrap().segments(0, pattern.len) {
            let start = (case.base as i64 + segment.offset) as usize;
            expected.extend((start..start + segment.len as usize).map(fill));
        }
        if packed != expected {
            failures.push(format!(
                "{compiler}: case {id}: MPI_Pack of {} x {t:?}: ours {expected:02x?}, MPI's {packed:02x?}",
                case.count
            ));
        }
    }
    failures
}
