//! Times one 4096 x 1 column of doubles (rows of 4097 doubles) moved
//! between two processes by VECTOR_WRITE (the column into a contiguous
//! window) and VECTOR_READ (a contiguous window into the column), against
//! a plain one-core strided copy of the same column in one process.
//! Prints one JSON line (medians in microseconds).
//!
//! `cargo run --release -p pindown-emu-device --example vector_column`
//! (build the device first: `cargo build --release -p pindown-emu-device`).
//! A figure, not a test: run it on an otherwise idle machine.

use std::path::Path;
use std::time::{Duration, Instant};

use pindown_driver::verbs::opcode::Vector;
use pindown_driver::verbs::{Context, ContextConfig};
use pindown_emu_device::testing::DeviceProcess;
use pindown_uapi::pattern::{Pattern, Piece};
use pindown_uapi::Access;

const ROWS: u64 = 4096;
const ROW: u64 = 4097 * 8;

/// Rounds per measurement (`VECTOR_ROUNDS`, default 300).
fn rounds() -> usize {
    std::env::var("VECTOR_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e6
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/pindown-emu-device");
    let device = DeviceProcess::start(&bin, 2, &[])?;
    let config = ContextConfig {
        arena_bytes: 160 << 20,
        ..ContextConfig::default()
    };
    let near = Context::open(device.socket(0), config.clone())?;
    let far = Context::open(device.socket(1), config)?;
    let matrix = near.alloc((ROWS * ROW) as usize, 4096)?;
    for row in 0..ROWS {
        matrix.write_at((row * ROW) as usize, &(row as f64).to_le_bytes());
    }
    let matrix_region = near.register_buffer(&matrix)?;
    let column = far.alloc((ROWS * 8) as usize, 64)?;
    let column_region = far.register_buffer(&column)?;
    let window = far.bind_window(
        &column_region,
        0,
        ROWS * 8,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    )?;
    let strided = Pattern::new(vec![Piece::vector(0, 8, ROWS, ROW as i64)], 1, 0)?;
    let contiguous = Pattern::contiguous(ROWS * 8);
    let whole = matrix_region.local(0, (ROWS * ROW) as u32)?;
    let write = Vector::write(
        whole,
        strided.clone(),
        window.remote().at(0),
        contiguous.clone(),
    )?;
    let read = Vector::read(whole, strided, window.remote().at(0), contiguous)?;
    let mut cq = near.create_completion_queue();
    let mut qp = near.create_queue_pair(&mut cq)?;
    let mut time = |vector: &Vector<'_>| -> Result<f64, Box<dyn std::error::Error>> {
        let mut times = Vec::with_capacity(rounds());
        for _ in 0..rounds() {
            let start = Instant::now();
            qp.post(&[vector.build().signaled()])?;
            let done = cq
                .wait(Duration::from_secs(5))?
                .next()
                .ok_or("no completion")?;
            done.result()?;
            times.push(start.elapsed());
        }
        Ok(median(times))
    };
    let write_us = time(&write)?;
    let mut landed = vec![0u8; 8];
    column.read_at((ROWS as usize - 1) * 8, &mut landed);
    assert_eq!(
        f64::from_le_bytes(landed.try_into().unwrap()),
        (ROWS - 1) as f64
    );
    let read_us = time(&read)?;
    // The plain copy: the same column gathered by one core, in one process.
    let base = matrix.as_ptr();
    let mut out = vec![0f64; ROWS as usize];
    let mut times = Vec::with_capacity(rounds());
    for _ in 0..rounds() {
        let start = Instant::now();
        for (row, value) in out.iter_mut().enumerate() {
            // SAFETY: inside the matrix buffer, which lives until the end.
            *value =
                unsafe { std::ptr::read_unaligned(base.add(row * ROW as usize) as *const f64) };
        }
        std::hint::black_box(&out);
        times.push(start.elapsed());
    }
    let copy_us = median(times);
    println!(
        "{{\"rows\":{ROWS},\"row_bytes\":{ROW},\"plain_copy_us\":{copy_us:.2},\
         \"vector_write_us\":{write_us:.2},\"vector_read_us\":{read_us:.2},\
         \"write_ratio\":{:.2},\"read_ratio\":{:.2}}}",
        write_us / copy_us,
        read_us / copy_us
    );
    Ok(())
}
