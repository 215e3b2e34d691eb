//! Ranks: the test binary started again as a child process that plays one
//! role (a driver on one port) and talks to the parent test over pipes.
//!
//! A test file that uses ranks has an ignored test named `rank_process`
//! that runs the role named by `PINDOWN_ROLE` on the socket
//! `PINDOWN_SOCKET` (and fails when they are unset); the parent starts it
//! with `--ignored`. A rank reads commands on stdin and
//! answers with lines starting `@@` on stdout ([`say`]).

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long [`Rank::next`] waits for an answer.
pub const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// In a rank: sends one answer line to the parent.
pub fn say(line: impl std::fmt::Display) {
    println!("@@{line}");
    std::io::stdout().flush().unwrap();
}

/// In a rank process: the role and socket it was started with. A rank
/// started by hand, without them, fails: it is never a test of its own.
pub fn role() -> (String, String) {
    match (
        std::env::var("PINDOWN_ROLE"),
        std::env::var("PINDOWN_SOCKET"),
    ) {
        (Ok(role), Ok(socket)) => (role, socket),
        _ => {
            panic!("rank_process runs only as a rank: PINDOWN_ROLE and PINDOWN_SOCKET must be set")
        }
    }
}

/// A rank, seen from the parent test.
pub struct Rank {
    /// The child process.
    pub child: Child,
    role: String,
    input: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Rank {
    /// Starts the test binary's `rank_process` test as role `role` on
    /// `socket`.
    pub fn start(role: &str, socket: &std::path::Path) -> Rank {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "rank_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("PINDOWN_ROLE", role)
            .env("PINDOWN_SOCKET", socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let input = child.stdin.take().unwrap();
        let output: ChildStdout = child.stdout.take().unwrap();
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(output).lines().map_while(Result::ok) {
                // The test harness may have written on the same line first.
                if let Some(at) = line.find("@@") {
                    if sender.send(line[at + 2..].to_owned()).is_err() {
                        break;
                    }
                }
            }
        });
        Rank {
            child,
            role: role.to_owned(),
            input,
            lines,
        }
    }

    /// The next answer (waits up to [`ANSWER_WAIT`]).
    pub fn next(&mut self) -> String {
        self.next_within(ANSWER_WAIT)
    }

    /// The next answer, waiting up to `wait`.
    pub fn next_within(&mut self, wait: Duration) -> String {
        match self.lines.recv_timeout(wait) {
            Ok(line) => line,
            Err(_) => {
                let status = self.child.try_wait().ok().flatten();
                panic!(
                    "rank `{}` gave no answer (exit status {status:?})",
                    self.role
                );
            }
        }
    }

    /// Sends one command line.
    pub fn send(&mut self, command: &str) {
        writeln!(self.input, "{command}").unwrap();
        self.input.flush().unwrap();
    }

    /// Sends a command and returns its answer.
    pub fn ask(&mut self, command: &str) -> String {
        self.send(command);
        self.next()
    }

    /// Asks the rank to exit and checks that it exits successfully.
    pub fn finish(mut self) {
        self.send("exit");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "rank `{}` exited with {status}",
                    self.role
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "rank `{}` did not exit",
                self.role
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `len` bytes of a reproducible pattern chosen by `seed` (xorshift), so
/// that two ranks can agree on bytes without sending them.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A fingerprint of `bytes` (FNV-1a), to compare memory across processes.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}
