//! Arrival notices a target does not take: the exercise the one-node and
//! the cross-node vector tests share.

use std::collections::HashSet;
use std::time::Duration;

use pindown_driver::verbs::opcode::{Entry, Vector};
use pindown_driver::verbs::{Context, Local, RemoteWindow};
use pindown_uapi::pattern::Pattern;
use pindown_uapi::{ErrorDetail, RemoteAddress, RemoteKey, Status};

/// Posts notifying copies of `small` (a vector write from `initiator`
/// into a window of `target`'s port) in batches of 32 while `target`
/// takes no arrival, until one is refused: it must be refused for
/// `NoticeLimit` only, after at least 4096 succeeded; then every write
/// that succeeded has exactly its arrival (naming `initiator`'s port and
/// node and `small`'s bytes), the refused one has none, and once they are
/// taken a notifying write succeeds and arrives again.
pub fn arrivals_are_bounded_and_none_is_dropped(
    initiator: &Context,
    target: &Context,
    small: &Vector<'_>,
) {
    let mut cq = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
    let (mut succeeded, mut refused) = (0u64, None);
    for batch in 0..1000u64 {
        let notifying: Vec<Vector<'_>> = (0..32)
            .map(|i| small.clone().notify(batch * 32 + i))
            .collect();
        let entries: Vec<Entry<'_>> = notifying
            .iter()
            .enumerate()
            .map(|(i, v)| v.build().signaled().user_data(batch * 32 + i as u64))
            .collect();
        qp.post(&entries).unwrap();
        let mut seen = 0;
        while seen < entries.len() {
            for done in cq.wait(Duration::from_secs(30)).unwrap() {
                seen += 1;
                if done.is_success() {
                    succeeded += 1;
                } else {
                    assert_eq!(
                        (done.status, done.detail),
                        (Status::LimitReached, ErrorDetail::NoticeLimit),
                        "{done:?}"
                    );
                    refused.get_or_insert(done.user_data);
                }
            }
        }
        if refused.is_some() {
            break;
        }
    }
    let refused = refused.expect("the arrivals a port holds are bounded");
    assert!(succeeded >= 4096, "{succeeded} arrivals held");
    let mut arrived = Vec::new();
    loop {
        let more = target.wait_arrivals(Duration::from_millis(500)).unwrap();
        if more.is_empty() {
            break;
        }
        arrived.extend(more);
    }
    assert_eq!(arrived.len() as u64, succeeded, "no arrival dropped");
    let immediates: HashSet<u64> = arrived.iter().map(|a| a.immediate).collect();
    assert_eq!(immediates.len() as u64, succeeded);
    assert!(!immediates.contains(&refused));
    let writer = initiator.info().address();
    assert!(arrived
        .iter()
        .all(|a| a.peer == writer && a.bytes == small.len()));
    // Taken: the port has room again.
    qp.post(&[small.clone().notify(1).build().signaled()])
        .unwrap();
    let done: Vec<_> = cq.wait(Duration::from_secs(30)).unwrap().collect();
    assert!(done.len() == 1 && done[0].is_success(), "{done:?}");
    assert_eq!(
        target.wait_arrivals(Duration::from_secs(10)).unwrap().len(),
        1
    );
}

/// A notifying vector write of no bytes from `initiator` (its local side
/// `empty`, a range of no bytes) names a window too: through a key of no
/// window (next to `writable`'s) or through `read_only` (a window
/// without the write right) it is refused, and `target` gets no arrival.
pub fn empty_notifying_writes_are_checked(
    initiator: &Context,
    target: &Context,
    empty: Local<'_>,
    writable: RemoteWindow,
    read_only: RemoteWindow,
) {
    let no_window = RemoteAddress {
        key: RemoteKey(writable.key.0 ^ 0x5a5a),
        ..writable.at(0)
    };
    for to in [no_window, read_only.at(0)] {
        let write = Vector::write(empty, Pattern::contiguous(0), to, Pattern::contiguous(0))
            .unwrap()
            .notify(0xe0);
        let mut cq = initiator.create_completion_queue();
        let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
        qp.post(&[write.build().signaled()]).unwrap();
        let done: Vec<_> = cq.wait(Duration::from_secs(30)).unwrap().collect();
        assert!(
            done.len() == 1 && done[0].status == Status::RemoteAccessError,
            "an empty write to {to:?}: {done:?}"
        );
    }
    assert!(target.arrivals().unwrap().is_empty());
}
