//! Detection from variables, the PMI-1 line format and chunking, and a
//! PMI-1 client against a scripted process manager on `PMI_PORT`
//! (well-behaved and hostile).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use proptest::prelude::*;

use super::pmi1::{
    check_reply, chunk_capacity, chunk_key, decode_header, encode_chunks, parse_reply,
    request_line, wire_safe, LINE_MAX,
};
use super::*;

fn vars(table: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
    let table: HashMap<String, OsString> = table
        .iter()
        .map(|(k, v)| (k.to_string(), OsString::from(v)))
        .collect();
    move |name: &str| table.get(name).cloned()
}

fn join(table: &[(&str, &str)]) -> Result<Job, LaunchError> {
    Job::from_variables(&vars(table))
}

fn variable_error(table: &[(&str, &str)]) -> (String, String) {
    match join(table) {
        Err(LaunchError::Variable { variable, reason }) => (variable, reason),
        other => panic!("{table:?}: expected a variable error, got {other:?}"),
    }
}

#[test]
fn no_variables_is_a_single_rank_whose_space_works_locally() {
    let mut job = join(&[]).unwrap();
    assert_eq!(
        (job.rank(), job.size(), job.launcher()),
        (0, 1, Launcher::Single)
    );
    assert_eq!((job.local_rank(), job.local_size()), (Some(0), Some(1)));
    job.put("addr", b"\x00port 0=").unwrap();
    job.fence().unwrap();
    assert_eq!(job.get(0, "addr").unwrap(), b"\x00port 0=");
    assert!(matches!(
        job.get(0, "other"),
        Err(LaunchError::NotFound { rank: 0, .. })
    ));
    assert!(matches!(
        job.get(1, "addr"),
        Err(LaunchError::RankOutOfRange { rank: 1, size: 1 })
    ));
    assert_eq!(
        job.all_gather("g", b"mine").unwrap(),
        vec![b"mine".to_vec()]
    );
    job.barrier().unwrap();
    job.finalize().unwrap();
}

#[test]
fn partial_or_inconsistent_variables_are_errors() {
    let (variable, _) = variable_error(&[("PINDOWN_RANK", "1")]);
    assert_eq!(variable, "PINDOWN_SIZE");
    let (variable, _) = variable_error(&[("PINDOWN_SIZE", "2")]);
    assert_eq!(variable, "PINDOWN_RANK");
    let (variable, reason) = variable_error(&[
        ("PINDOWN_RANK", "2"),
        ("PINDOWN_SIZE", "2"),
        ("PINDOWN_KV_DIR", "/tmp"),
    ]);
    assert_eq!(variable, "PINDOWN_RANK");
    assert!(reason.contains("not below"), "{reason}");
    let (variable, _) = variable_error(&[("PINDOWN_RANK", "0"), ("PINDOWN_SIZE", "2")]);
    assert_eq!(variable, "PINDOWN_KV_DIR");
    let (variable, _) = variable_error(&[("PINDOWN_RANK", "0"), ("PINDOWN_SIZE", "0")]);
    assert_eq!(variable, "PINDOWN_SIZE");
    let (variable, reason) = variable_error(&[("PINDOWN_RANK", "-1"), ("PINDOWN_SIZE", "2")]);
    assert_eq!(variable, "PINDOWN_RANK");
    assert!(reason.contains("\"-1\""), "{reason}");
    let (variable, _) = variable_error(&[("PINDOWN_RANK", "99999999999"), ("PINDOWN_SIZE", "2")]);
    assert_eq!(variable, "PINDOWN_RANK");
    // PMI-1 leftovers without a connection.
    let (variable, reason) = variable_error(&[("PMI_RANK", "0"), ("PMI_SIZE", "4")]);
    assert_eq!(variable, "PMI_RANK");
    assert!(reason.contains("PMI_FD"), "{reason}");
    // Open MPI's rank without its size, a rank beyond the size.
    let (variable, _) = variable_error(&[("OMPI_COMM_WORLD_RANK", "0")]);
    assert_eq!(variable, "OMPI_COMM_WORLD_SIZE");
    let (variable, _) =
        variable_error(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]);
    assert_eq!(variable, "OMPI_COMM_WORLD_RANK");
    // A broken timeout.
    let (variable, _) = variable_error(&[("PINDOWN_LAUNCH_TIMEOUT", "soon")]);
    assert_eq!(variable, "PINDOWN_LAUNCH_TIMEOUT");
}

#[test]
fn pmi_fd_that_is_not_an_open_socket_is_an_error() {
    let (variable, reason) =
        variable_error(&[("PMI_FD", "x"), ("PMI_RANK", "0"), ("PMI_SIZE", "1")]);
    assert_eq!(variable, "PMI_FD");
    assert!(reason.contains("not a file descriptor"), "{reason}");
    // A closed descriptor: open a file, note its number, close it.
    let file = std::fs::File::open("/dev/null").unwrap();
    let closed = std::os::fd::AsRawFd::as_raw_fd(&file).to_string();
    drop(file);
    let (variable, reason) =
        variable_error(&[("PMI_FD", &closed), ("PMI_RANK", "0"), ("PMI_SIZE", "1")]);
    assert_eq!(variable, "PMI_FD");
    assert!(reason.contains("not an open file descriptor"), "{reason}");
    // An open descriptor that is not a socket.
    let file = std::fs::File::open("/dev/null").unwrap();
    let open = std::os::fd::AsRawFd::as_raw_fd(&file).to_string();
    let (variable, reason) =
        variable_error(&[("PMI_FD", &open), ("PMI_RANK", "0"), ("PMI_SIZE", "1")]);
    assert_eq!(variable, "PMI_FD");
    assert!(reason.contains("not a socket"), "{reason}");
    drop(file);
}

#[test]
fn the_environment_launcher_refuses_an_earlier_jobs_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    let table = [
        ("PINDOWN_RANK", "0"),
        ("PINDOWN_SIZE", "1"),
        ("PINDOWN_KV_DIR", path),
    ];
    let mut job = join(&table).unwrap();
    assert_eq!(job.launcher(), Launcher::Environment);
    let value: Vec<u8> = (0..=255).collect();
    assert_eq!(job.all_gather("addr", &value).unwrap(), vec![value.clone()]);
    assert_eq!(job.get(0, "addr").unwrap(), value);
    // A value file larger than any value is refused, not read whole.
    std::fs::write(dir.path().join("v.0.big"), vec![7u8; MAX_VALUE_LEN + 1]).unwrap();
    assert!(matches!(
        job.get(0, "big"),
        Err(LaunchError::Malformed { rank: 0, .. })
    ));
    drop(job);
    match join(&table) {
        Err(LaunchError::Directory { reason, .. }) => {
            assert!(reason.contains("earlier job"), "{reason}")
        }
        other => panic!("expected a directory error, got {other:?}"),
    }
}

#[test]
fn the_environment_fence_times_out_naming_the_missing_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    let mut job = join(&[
        ("PINDOWN_RANK", "1"),
        ("PINDOWN_SIZE", "3"),
        ("PINDOWN_KV_DIR", path),
        ("PINDOWN_LAUNCH_TIMEOUT", "1"),
    ])
    .unwrap();
    match job.fence() {
        Err(LaunchError::Timeout { what, .. }) => {
            assert!(what.contains("rank(s) 0, 2 never arrived"), "{what}")
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn keys_are_checked() {
    for key in ["", "a b", "a=b", "a/b", "ü", &"k".repeat(MAX_KEY_LEN + 1)] {
        assert!(
            matches!(check_key(key), Err(LaunchError::InvalidKey { .. })),
            "{key:?}"
        );
    }
    for key in ["a", "addr.0", "A-z_9", &"k".repeat(MAX_KEY_LEN)] {
        check_key(key).unwrap();
    }
    let mut job = Job::single();
    assert!(matches!(
        job.put("x", &vec![0; MAX_VALUE_LEN + 1]),
        Err(LaunchError::ValueTooLarge { .. })
    ));
}

#[test]
fn hex_round_trips_and_rejects_garbage() {
    let bytes: Vec<u8> = (0..=255).collect();
    assert_eq!(hex_decode(&hex_encode(&bytes)).unwrap(), bytes);
    assert_eq!(hex_decode("ABcd").unwrap(), vec![0xab, 0xcd]);
    assert!(hex_decode("abc").is_err());
    assert!(hex_decode("zz").is_err());
    assert!(hex_decode("é0").is_err());
}

#[test]
fn replies_parse_and_hostile_ones_are_errors() {
    let reply = parse_reply("cmd=get_result rc=0 msg=success value=ab=cd").unwrap();
    assert_eq!(reply.command(), "get_result");
    assert_eq!(reply.get("rc"), Some("0"));
    // The value is everything after the first '='.
    assert_eq!(reply.get("value"), Some("ab=cd"));
    // A message with spaces stays one value.
    let reply = parse_reply("cmd=put_result rc=-1 msg=key exists  already").unwrap();
    assert_eq!(reply.get("msg"), Some("key exists already"));
    for hostile in ["", "   ", "value=1 cmd=x", "=x", "nonsense", "rc=0"] {
        assert!(parse_reply(hostile).is_err(), "{hostile:?}");
    }
    assert!(check_reply("put", "cmd=put_result rc=0", "put_result").is_ok());
    for (reply, expect) in [
        ("cmd=put_result rc=-1 msg=duplicate_key", "put_result"),
        ("cmd=barrier_out", "put_result"),
        ("cmd=put_result rc=", "put_result"),
        ("garbage", "put_result"),
    ] {
        match check_reply("put", reply, expect) {
            Err(LaunchError::Protocol {
                command,
                reply: shown,
                ..
            }) => {
                assert_eq!((command.as_str(), shown.as_str()), ("put", reply));
            }
            other => panic!("{reply:?}: {other:?}"),
        }
    }
}

proptest! {
    #[test]
    fn parse_never_panics(line in ".{0,200}") {
        let _ = parse_reply(&line);
        let _ = check_reply("x", &line, "y");
        let _ = decode_header(&line);
        let _ = hex_decode(&line);
    }

    #[test]
    fn chunks_round_trip_and_fit_the_line(
        value in proptest::collection::vec(any::<u8>(), 0..3000),
        vallen_max in 16usize..2000,
        kvsname_len in 1usize..300,
    ) {
        let kvsname = "k".repeat(kvsname_len);
        let longest = chunk_key("addr", 7, MAX_VALUE_LEN as u32).len();
        let Some(capacity) = chunk_capacity(vallen_max, &kvsname, longest) else {
            return Ok(());
        };
        let chunks = encode_chunks(&value, capacity);
        for (i, chunk) in chunks.iter().enumerate() {
            prop_assert!(wire_safe(chunk));
            prop_assert!(chunk.len() < vallen_max);
            let key = chunk_key("addr", 7, i as u32);
            let line = request_line("put", &[("kvsname", &kvsname), ("key", &key), ("value", chunk)]);
            prop_assert!(line.len() <= LINE_MAX, "{} bytes", line.len());
        }
        let (count, first) = decode_header(&chunks[0]).unwrap();
        prop_assert_eq!(count as usize, chunks.len());
        let mut hex = first.to_string();
        for chunk in &chunks[1..] {
            hex.push_str(chunk);
        }
        prop_assert_eq!(hex_decode(&hex).unwrap(), value);
    }
}

/// A scripted PMI-1 process manager on a TCP port: `answer` gets each
/// request line and returns the reply lines (with newlines), or `None`
/// to close the connection. Returns the port and the thread.
fn process_manager(
    mut answer: impl FnMut(&str) -> Option<String> + Send + 'static,
) -> (String, JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().to_string();
    let thread = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut writer = stream.try_clone().unwrap();
        let mut seen = Vec::new();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            seen.push(line.clone());
            match answer(&line) {
                Some(reply) => {
                    if writer.write_all(reply.as_bytes()).is_err() {
                        break;
                    }
                }
                None => break,
            }
        }
        seen
    });
    (port, thread)
}

/// A well-behaved single-process manager with the given limits, keeping
/// its key-value space in `space`.
fn hydra_like(
    vallen_max: usize,
    space: Arc<Mutex<HashMap<String, String>>>,
) -> impl FnMut(&str) -> Option<String> + Send + 'static {
    move |line: &str| {
        let request = parse_reply(line).expect("the client sends well-formed lines");
        Some(match request.command() {
            "initack" => "cmd=initack\ncmd=set size=1\ncmd=set rank=0\ncmd=set debug=0\n".into(),
            "init" => "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n".into(),
            "get_maxes" => {
                format!("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max={vallen_max}\n")
            }
            "get_my_kvsname" => "cmd=my_kvsname kvsname=kvs_42_0\n".into(),
            "put" => {
                assert_eq!(request.get("kvsname"), Some("kvs_42_0"));
                let value = request.get("value").unwrap().to_string();
                assert!(value.len() < vallen_max && wire_safe(&value) || value.is_empty());
                assert!(line.len() < LINE_MAX);
                space
                    .lock()
                    .unwrap()
                    .insert(request.get("key").unwrap().into(), value);
                "cmd=put_result rc=0 msg=success\n".into()
            }
            "barrier_in" => "cmd=barrier_out\n".into(),
            "get" => match space.lock().unwrap().get(request.get("key").unwrap()) {
                Some(value) => format!("cmd=get_result rc=0 msg=success value={value}\n"),
                None => "cmd=get_result rc=-1 msg=key_not_found\n".into(),
            },
            "finalize" => "cmd=finalize_ack\n".into(),
            other => panic!("unexpected command {other}"),
        })
    }
}

#[test]
fn pmi_port_client_splits_long_values_over_keys() {
    let space = Arc::new(Mutex::new(HashMap::new()));
    let (port, thread) = process_manager(hydra_like(64, space.clone()));
    let mut job = join(&[("PMI_PORT", &port), ("PMI_ID", "0")]).unwrap();
    assert_eq!(
        (job.rank(), job.size(), job.launcher()),
        (0, 1, Launcher::Hydra)
    );
    let value: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
    let gathered = job.all_gather("addr", &value).unwrap();
    assert_eq!(gathered, vec![value.clone()]);
    // Read back from the process manager, not from the local copy.
    assert_eq!(job.get(0, "addr").unwrap(), value);
    let empty = job.all_gather("empty", b"").unwrap();
    assert_eq!(empty, vec![Vec::<u8>::new()]);
    assert_eq!(job.get(0, "empty").unwrap(), b"");
    assert!(matches!(
        job.get(0, "missing"),
        Err(LaunchError::NotFound { rank: 0, .. })
    ));
    job.finalize().unwrap();
    let seen = thread.join().unwrap();
    assert_eq!(seen[0], "cmd=initack pmiid=0");
    assert_eq!(seen.last().unwrap(), "cmd=finalize");
    // 2000 hex digits in chunks of fewer than 64 bytes: many keys.
    let keys = space.lock().unwrap().len();
    assert!(keys > 2000 / 64, "{keys} keys");
}

#[test]
fn pmi_port_without_id_takes_rank_and_size_from_variables() {
    let space = Arc::new(Mutex::new(HashMap::new()));
    let (port, thread) = process_manager(hydra_like(1024, space));
    let job = join(&[("PMI_PORT", &port), ("PMI_RANK", "2"), ("PMI_SIZE", "5")]).unwrap();
    assert_eq!((job.rank(), job.size()), (2, 5));
    drop(job); // finalizes
    let seen = thread.join().unwrap();
    assert_eq!(seen[0], "cmd=init pmi_version=1 pmi_subversion=1");
    assert_eq!(seen.last().unwrap(), "cmd=finalize");
}

/// Joins through a process manager that answers `bad` (or closes, for
/// `None`) to each request that is `when` or starts with `when` and a
/// space, and
/// returns the error of whatever fails.
fn hostile(when: &'static str, bad: Option<&'static str>) -> LaunchError {
    let space = Arc::new(Mutex::new(HashMap::new()));
    let mut good = hydra_like(1024, space);
    let (port, thread) = process_manager(move |line| {
        if line == when || line.starts_with(&format!("{when} ")) {
            bad.map(String::from)
        } else {
            good(line)
        }
    });
    let result = join(&[
        ("PMI_PORT", &port),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("PINDOWN_LAUNCH_TIMEOUT", "2"),
    ])
    .and_then(|mut job| {
        job.put("addr", b"0123")?;
        job.fence()?;
        job.get(1, "addr")
    });
    let error = result.expect_err("a hostile process manager is an error");
    drop(thread);
    error
}

#[test]
fn hostile_process_managers_are_errors_naming_the_command_and_reply() {
    let cases: &[(&str, Option<&str>, &str)] = &[
        ("cmd=init", None, "PMI-2"),
        ("cmd=init", Some("cmd=response_to_init rc=-1\n"), "rc=-1"),
        (
            "cmd=init",
            Some("cmd=response_to_init pmi_version=2 rc=0\n"),
            "version 1",
        ),
        (
            "cmd=init",
            Some("    38cmd=response_to_init;rc=0;\n"),
            "PMI-2 only",
        ),
        (
            "cmd=get_maxes",
            Some("cmd=maxes vallen_max=x\n"),
            "kvsname_max",
        ),
        (
            "cmd=get_maxes",
            Some("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=99999999999999999999\n"),
            "vallen_max",
        ),
        (
            "cmd=get_my_kvsname",
            Some("cmd=my_kvsname kvsname=\n"),
            "kvsname",
        ),
        (
            "cmd=put",
            Some("cmd=put_result rc=-1 msg=duplicate\n"),
            "duplicate",
        ),
        (
            "cmd=put",
            Some("cmd=barrier_out\n"),
            "expected cmd=put_result",
        ),
        (
            "cmd=put",
            Some("cmd=put_result rc=0"),
            "PINDOWN_LAUNCH_TIMEOUT",
        ),
        ("cmd=put", Some("\u{0}\u{1}\n"), "not key=value"),
        ("cmd=barrier_in", None, "closed the connection"),
        (
            "cmd=get",
            Some("cmd=get_result rc=0 value=1:zz\n"),
            "not hexadecimal",
        ),
        (
            "cmd=get",
            Some("cmd=get_result rc=0 value=4000000000:00\n"),
            "out of range",
        ),
        (
            "cmd=get kvsname=kvs_42_0 key=pd.addr.1",
            Some("cmd=get_result rc=0 value=3:00\n"),
            "chunk 1 of 3 is missing",
        ),
        (
            "cmd=get",
            Some("cmd=get_result rc=0 value=nothing\n"),
            "no chunk count",
        ),
    ];
    for &(when, bad, expected) in cases {
        let error = hostile(when, bad).to_string();
        assert!(
            error.contains(expected),
            "{when} -> {bad:?}: {error:?} does not say {expected:?}"
        );
    }
}

#[test]
fn an_endless_reply_line_is_an_error() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().to_string();
    let thread = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let block = vec![b'x'; 1 << 16];
        for _ in 0..4 {
            if stream.write_all(&block).is_err() {
                break;
            }
        }
    });
    let error = join(&[("PMI_PORT", &port), ("PMI_RANK", "0"), ("PMI_SIZE", "1")]).unwrap_err();
    assert!(error.to_string().contains("no end of line"), "{error}");
    thread.join().unwrap();
}

#[test]
fn an_unreachable_pmi_port_is_an_error() {
    // A port that was just free: nobody listens there.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let (variable, reason) =
        variable_error(&[("PMI_PORT", &port), ("PMI_RANK", "0"), ("PMI_SIZE", "1")]);
    assert_eq!(variable, "PMI_PORT");
    assert!(reason.contains("cannot connect"), "{reason}");
    let (variable, _) = variable_error(&[
        ("PMI_PORT", "no-port-here"),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "1"),
    ]);
    assert_eq!(variable, "PMI_PORT");
}

#[test]
fn a_job_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<Job>();
    let job = Job::single();
    let rank = std::thread::spawn(move || job.rank()).join().unwrap();
    assert_eq!(rank, 0);
}

#[test]
fn the_device_socket_comes_from_pindown_device_or_the_directory_and_local_rank() {
    let job_with_local = |local: Option<(u32, u32)>| Job {
        rank: 5,
        size: 8,
        local,
        launcher: Launcher::Environment,
        space: Some(Space::Local(HashMap::new())),
    };
    let third = job_with_local(Some((3, 4)));
    // PINDOWN_DEVICE wins over the directory.
    let both = vars(&[
        ("PINDOWN_DEVICE", "/run/dev/node1/port1.sock"),
        ("PINDOWN_DEVICE_DIR", "/run/dev/node0"),
    ]);
    assert_eq!(
        device_socket_from(&both, &third).unwrap(),
        PathBuf::from("/run/dev/node1/port1.sock")
    );
    // The directory: the local rank picks the port.
    let dir = vars(&[("PINDOWN_DEVICE_DIR", "/run/dev/node0")]);
    assert_eq!(
        device_socket_from(&dir, &third).unwrap(),
        PathBuf::from("/run/dev/node0/port3.sock")
    );
    assert_eq!(
        device_socket_from(&dir, &job_with_local(Some((0, 4)))).unwrap(),
        PathBuf::from("/run/dev/node0/port0.sock")
    );
    // No local rank: the directory cannot pick a port.
    match device_socket_from(&dir, &job_with_local(None)) {
        Err(LaunchError::Variable { variable, reason }) => {
            assert_eq!(variable, "PINDOWN_DEVICE_DIR");
            assert!(reason.contains("local rank"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // Neither variable, or an empty one: errors naming them.
    for table in [
        &[][..],
        &[("PINDOWN_DEVICE", "")][..],
        &[("PINDOWN_DEVICE_DIR", "")][..],
    ] {
        match device_socket_from(&vars(table), &third) {
            Err(LaunchError::Variable { variable, reason }) => {
                assert!(variable.starts_with("PINDOWN_DEVICE"), "{variable}");
                assert!(
                    reason.contains("PINDOWN_DEVICE") || reason.contains("empty"),
                    "{reason}"
                );
            }
            other => panic!("{table:?}: {other:?}"),
        }
    }
}
