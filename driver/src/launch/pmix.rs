//! PMIx client through the launcher's own library, loaded at run time.
//!
//! Open MPI's `mpirun` (and `srun --mpi=pmix`, `prterun`) run a PMIx
//! server and tell their processes how to reach it (`PMIX_*` variables).
//! The server's key-value space is reached with the PMIx client library
//! of the same installation: `libpmix.so.2` (PMIx 4; override with
//! `PINDOWN_PMIX_LIBRARY`), opened with `dlopen` when a job is joined, so
//! that building and running without Open MPI needs no PMIx at all. It is
//! opened `RTLD_GLOBAL`, as the library's own plugins need, and never
//! closed (its threads may outlive `PMIx_Finalize`).
//!
//! The structures below mirror `pmix_common.h` of PMIx 4 on 64-bit
//! Linux; a test compiles a C program against the installed headers and
//! compares sizes, offsets and constants.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use super::{text, LaunchError, Launcher, Variables, MAX_VALUE_LEN};

/// `PMIX_MAX_NSLEN`: a namespace has at most this many characters.
pub(crate) const MAX_NSLEN: usize = 255;
/// `PMIX_MAX_KEYLEN`.
pub(crate) const MAX_KEYLEN: usize = 511;
/// `PMIX_SUCCESS`.
pub(crate) const SUCCESS: c_int = 0;
/// `PMIX_GLOBAL`: a put visible to every process of the job.
pub(crate) const SCOPE_GLOBAL: u8 = 3;
/// `PMIX_RANK_WILDCARD`: every rank of a namespace.
pub(crate) const RANK_WILDCARD: u32 = u32::MAX - 1;
/// `PMIX_BOOL`.
pub(crate) const TYPE_BOOL: u16 = 1;
/// `PMIX_UINT16`.
pub(crate) const TYPE_UINT16: u16 = 13;
/// `PMIX_UINT32`.
pub(crate) const TYPE_UINT32: u16 = 14;
/// `PMIX_BYTE_OBJECT`.
pub(crate) const TYPE_BYTE_OBJECT: u16 = 27;
/// `PMIX_PROC_RANK`.
pub(crate) const TYPE_PROC_RANK: u16 = 40;
/// `PMIX_COLLECT_DATA`: a fence that also collects every rank's puts.
pub(crate) const KEY_COLLECT_DATA: &CStr = c"pmix.collect";
/// `PMIX_OPTIONAL`: a get that looks only in the local store (where a
/// collecting fence put every rank's data) instead of asking the server
/// and waiting for a key that may never come.
pub(crate) const KEY_OPTIONAL: &CStr = c"pmix.optional";
/// `PMIX_ERR_NOT_FOUND`.
pub(crate) const ERR_NOT_FOUND: c_int = -46;
/// `PMIX_JOB_SIZE`.
pub(crate) const KEY_JOB_SIZE: &CStr = c"pmix.job.size";
/// `PMIX_LOCAL_RANK`.
pub(crate) const KEY_LOCAL_RANK: &CStr = c"pmix.lrank";
/// `PMIX_LOCAL_SIZE`.
pub(crate) const KEY_LOCAL_SIZE: &CStr = c"pmix.local.size";

/// The library opened unless `PINDOWN_PMIX_LIBRARY` names another.
pub const DEFAULT_LIBRARY: &str = "libpmix.so.2";

/// `pmix_proc_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Proc {
    pub(crate) nspace: [c_char; MAX_NSLEN + 1],
    pub(crate) rank: u32,
}

/// `pmix_byte_object_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ByteObject {
    pub(crate) bytes: *mut c_char,
    pub(crate) size: usize,
}

/// The members of `pmix_value_t`'s union used here; `_whole` gives the
/// union its C size (its largest members are three words).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ValueData {
    pub(crate) flag: bool,
    pub(crate) uint16: u16,
    pub(crate) uint32: u32,
    pub(crate) rank: u32,
    pub(crate) bo: ByteObject,
    _whole: [u64; 3],
}

/// `pmix_value_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Value {
    pub(crate) type_: u16,
    pub(crate) data: ValueData,
}

/// `pmix_info_t`.
#[repr(C)]
pub(crate) struct Info {
    pub(crate) key: [c_char; MAX_KEYLEN + 1],
    pub(crate) flags: u32,
    pub(crate) value: Value,
}

impl Info {
    /// An info `key` = `value`.
    fn new(key: &CStr, value: Value) -> Info {
        let mut info = Info {
            key: [0; MAX_KEYLEN + 1],
            flags: 0,
            value,
        };
        for (slot, &byte) in info.key.iter_mut().zip(key.to_bytes()) {
            *slot = byte as c_char;
        }
        info
    }
}

type InitFn = unsafe extern "C" fn(*mut Proc, *mut Info, usize) -> c_int;
type FinalizeFn = unsafe extern "C" fn(*const Info, usize) -> c_int;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> c_int;
type CommitFn = unsafe extern "C" fn() -> c_int;
type FenceFn = unsafe extern "C" fn(*const Proc, usize, *const Info, usize) -> c_int;
type GetFn =
    unsafe extern "C" fn(*const Proc, *const c_char, *const Info, usize, *mut *mut Value) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type ValueDestructFn = unsafe extern "C" fn(*mut Value);

/// The PMIx calls used, from the loaded library.
struct Api {
    init: InitFn,
    finalize: FinalizeFn,
    put: PutFn,
    commit: CommitFn,
    fence: FenceFn,
    get: GetFn,
    error_string: ErrorStringFn,
    value_destruct: ValueDestructFn,
    _library: libloading::os::unix::Library,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

impl Api {
    fn load(path: &str) -> Result<Api, String> {
        use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: opening the PMIx library runs its initializers, which
        // only set up its own state; it is the launcher's own client
        // library, meant to be loaded into its processes.
        let library =
            unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
                let cause = std::error::Error::source(&e).map(|s| format!(": {s}"));
                format!("cannot load {path}: {e}{}", cause.unwrap_or_default())
            })?;
        macro_rules! symbol {
            ($name:literal, $type:ty) => {
                // SAFETY: the type is the function's C prototype from
                // PMIx 4's pmix.h (checked against the installed header by
                // a test); the pointer stays valid as `library` is kept
                // for the process's lifetime.
                *unsafe { library.get::<$type>($name) }
                    .map_err(|e| format!("{path} has no {}: {e}", $name))?
            };
        }
        Ok(Api {
            init: symbol!("PMIx_Init", InitFn),
            finalize: symbol!("PMIx_Finalize", FinalizeFn),
            put: symbol!("PMIx_Put", PutFn),
            commit: symbol!("PMIx_Commit", CommitFn),
            fence: symbol!("PMIx_Fence", FenceFn),
            get: symbol!("PMIx_Get", GetFn),
            error_string: symbol!("PMIx_Error_string", ErrorStringFn),
            value_destruct: symbol!("PMIx_Value_destruct", ValueDestructFn),
            _library: library,
        })
    }

    fn status_name(&self, status: c_int) -> String {
        // SAFETY: PMIx_Error_string takes any status and returns a static
        // string (or NULL, checked).
        let name = unsafe { (self.error_string)(status) };
        if name.is_null() {
            return "unknown status".into();
        }
        // SAFETY: a non-NULL result is a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    fn check(&self, call: &str, status: c_int, detail: String) -> Result<(), LaunchError> {
        if status == SUCCESS {
            return Ok(());
        }
        Err(LaunchError::Pmix {
            call: call.into(),
            status,
            status_name: self.status_name(status),
            detail,
        })
    }
}

/// A joined PMIx job.
pub(crate) struct Client {
    api: &'static Api,
    proc: Proc,
    size: u32,
    local: Option<(u32, u32)>,
}

// SAFETY: the client holds plain data and a reference to the loaded
// library's function table; PMIx's client calls are thread safe.
unsafe impl Send for Client {}

impl Client {
    /// Loads the library, initializes the client, and learns the job's
    /// size and this rank's place on its host.
    pub(crate) fn join(vars: &dyn Variables, launcher: Launcher) -> Result<Client, LaunchError> {
        let path = text(vars, "PINDOWN_PMIX_LIBRARY")?.unwrap_or_else(|| DEFAULT_LIBRARY.into());
        let api = API
            .get_or_init(|| Api::load(&path))
            .as_ref()
            .map_err(|reason| LaunchError::PmixUnavailable {
                launcher,
                reason: reason.clone(),
            })?;
        if vars.var("PMIX_SERVER_URI41").is_none()
            && vars.var("PMIX_SERVER_URI4").is_none()
            && vars.var("PMIX_SERVER_URI3").is_none()
            && vars.var("PMIX_SERVER_URI2").is_none()
            && vars.var("PMIX_NAMESPACE").is_none()
        {
            return Err(LaunchError::PmixUnavailable {
                launcher,
                reason: "no PMIX_SERVER_URI* or PMIX_NAMESPACE variable: the launcher's PMIx \
                         server did not tell this process how to reach it"
                    .into(),
            });
        }
        let mut proc = Proc {
            nspace: [0; MAX_NSLEN + 1],
            rank: 0,
        };
        // SAFETY: `proc` is a writable pmix_proc_t; no info array.
        let status = unsafe { (api.init)(&mut proc, std::ptr::null_mut(), 0) };
        api.check(
            "PMIx_Init",
            status,
            format!(" ({launcher} started this process; is its PMIx server still running?)"),
        )?;
        let mut client = Client {
            api,
            proc,
            size: 0,
            local: None,
        };
        let job = client.wildcard();
        client.size = client.get_number(&job, KEY_JOB_SIZE)?;
        if client.size == 0 || client.proc.rank >= client.size {
            return Err(LaunchError::Pmix {
                call: "PMIx_Get(pmix.job.size)".into(),
                status: 0,
                status_name: "inconsistent".into(),
                detail: format!(": rank {} of {} ranks", client.proc.rank, client.size),
            });
        }
        let me = client.proc;
        let local_rank = client.get_number(&me, KEY_LOCAL_RANK).ok();
        let local_size = client.get_number(&job, KEY_LOCAL_SIZE).ok();
        if let (Some(rank), Some(size)) = (local_rank, local_size) {
            if rank < size {
                client.local = Some((rank, size));
            }
        }
        Ok(client)
    }

    /// This process's rank in its namespace.
    pub(crate) fn rank(&self) -> u32 {
        self.proc.rank
    }

    /// The namespace's size.
    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    /// Local rank and size, if the server said.
    pub(crate) fn local(&self) -> Option<(u32, u32)> {
        self.local
    }

    fn wildcard(&self) -> Proc {
        Proc {
            rank: RANK_WILDCARD,
            ..self.proc
        }
    }

    fn key(key: &str) -> CString {
        // Checked keys hold no NUL and are far below PMIX_MAX_KEYLEN.
        CString::new(format!("pindown.{key}")).expect("checked key has no NUL")
    }

    /// `PMIx_Get` of a number-valued key.
    fn get_number(&self, proc: &Proc, key: &CStr) -> Result<u32, LaunchError> {
        let value = self.get_value(proc, key, false)?;
        // SAFETY: the union member read is the one `type_` names.
        let number = unsafe {
            match value.type_ {
                TYPE_UINT32 => Some(value.data.uint32),
                TYPE_PROC_RANK => Some(value.data.rank),
                TYPE_UINT16 => Some(u32::from(value.data.uint16)),
                _ => None,
            }
        };
        let type_ = value.type_;
        drop(value);
        number.ok_or_else(|| LaunchError::Pmix {
            call: format!("PMIx_Get({})", key.to_string_lossy()),
            status: 0,
            status_name: "unexpected type".into(),
            detail: format!(": PMIx data type {type_}"),
        })
    }

    /// `PMIx_Get`, the value owned by a guard that releases it.
    fn get_value(
        &self,
        proc: &Proc,
        key: &CStr,
        local_only: bool,
    ) -> Result<ValueGuard, LaunchError> {
        let mut value: *mut Value = std::ptr::null_mut();
        let optional = Info::new(
            KEY_OPTIONAL,
            Value {
                type_: TYPE_BOOL,
                data: ValueData { flag: true },
            },
        );
        let (infos, count) = if local_only {
            (&optional as *const Info, 1)
        } else {
            (std::ptr::null(), 0)
        };
        // SAFETY: `proc`, `key` and zero or one info are valid for the
        // call, and `value` receives a pointer the library allocated.
        let status = unsafe { (self.api.get)(proc, key.as_ptr(), infos, count, &mut value) };
        self.api.check(
            "PMIx_Get",
            status,
            format!(" (key {} of rank {})", key.to_string_lossy(), proc.rank),
        )?;
        if value.is_null() {
            return Err(LaunchError::Pmix {
                call: "PMIx_Get".into(),
                status,
                status_name: "no value".into(),
                detail: format!(" (key {})", key.to_string_lossy()),
            });
        }
        Ok(ValueGuard {
            api: self.api,
            value,
        })
    }

    /// `PMIx_Put` of a byte object in the global scope.
    pub(crate) fn put(&mut self, key: &str, value: &[u8]) -> Result<(), LaunchError> {
        let name = Self::key(key);
        let mut object = Value {
            type_: TYPE_BYTE_OBJECT,
            data: ValueData {
                bo: ByteObject {
                    bytes: value.as_ptr() as *mut c_char,
                    size: value.len(),
                },
            },
        };
        // SAFETY: `name` is a NUL-terminated key, `object` a byte object
        // naming `value`'s bytes for the call's duration; PMIx_Put copies
        // the data and does not write through the pointer.
        let status = unsafe { (self.api.put)(SCOPE_GLOBAL, name.as_ptr(), &mut object) };
        self.api.check(
            "PMIx_Put",
            status,
            format!(" (key {})", name.to_string_lossy()),
        )
    }

    /// `PMIx_Commit`, then `PMIx_Fence` over the whole namespace, with
    /// `PMIX_COLLECT_DATA` if `collect`.
    pub(crate) fn fence(&mut self, collect: bool) -> Result<(), LaunchError> {
        if collect {
            // SAFETY: no arguments.
            let status = unsafe { (self.api.commit)() };
            self.api.check("PMIx_Commit", status, String::new())?;
        }
        let all = self.wildcard();
        let info = Info::new(
            KEY_COLLECT_DATA,
            Value {
                type_: TYPE_BOOL,
                data: ValueData { flag: true },
            },
        );
        let (infos, count) = if collect {
            (&info as *const Info, 1)
        } else {
            (std::ptr::null(), 0)
        };
        // SAFETY: one proc (the namespace's wildcard) and zero or one
        // info, all alive for the call.
        let status = unsafe { (self.api.fence)(&all, 1, infos, count) };
        self.api.check("PMIx_Fence", status, String::new())
    }

    /// The bytes `rank` put under `key`.
    pub(crate) fn get(&mut self, rank: u32, key: &str) -> Result<Vec<u8>, LaunchError> {
        let name = Self::key(key);
        let proc = Proc { rank, ..self.proc };
        let value = match self.get_value(&proc, &name, true) {
            Err(LaunchError::Pmix {
                status: ERR_NOT_FOUND,
                status_name,
                ..
            }) => {
                return Err(LaunchError::NotFound {
                    rank,
                    key: key.into(),
                    detail: format!(": PMIx_Get says {status_name}"),
                })
            }
            other => other?,
        };
        let malformed = |reason: String| LaunchError::Malformed {
            rank,
            key: key.into(),
            reason,
        };
        if value.type_ != TYPE_BYTE_OBJECT {
            return Err(malformed(format!(
                "PMIx data type {}, not a byte object",
                value.type_
            )));
        }
        // SAFETY: the type says the union holds a byte object.
        let object = unsafe { value.data.bo };
        if object.size > MAX_VALUE_LEN {
            return Err(malformed(format!("{} bytes", object.size)));
        }
        if object.size == 0 || object.bytes.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: a byte object from PMIx_Get names `size` readable bytes
        // owned by the value, alive until the guard releases it.
        let bytes = unsafe { std::slice::from_raw_parts(object.bytes.cast::<u8>(), object.size) };
        Ok(bytes.to_vec())
    }

    /// `PMIx_Finalize`.
    pub(crate) fn finalize(self) -> Result<(), LaunchError> {
        // SAFETY: no info array.
        let status = unsafe { (self.api.finalize)(std::ptr::null(), 0) };
        self.api.check("PMIx_Finalize", status, String::new())
    }
}

/// A value returned by `PMIx_Get`, released on drop.
struct ValueGuard {
    api: &'static Api,
    value: *mut Value,
}

impl std::ops::Deref for ValueGuard {
    type Target = Value;
    fn deref(&self) -> &Value {
        // SAFETY: a non-NULL value from PMIx_Get, alive until drop.
        unsafe { &*self.value }
    }
}

impl Drop for ValueGuard {
    fn drop(&mut self) {
        // SAFETY: PMIX_VALUE_RELEASE: the value and its data were
        // allocated by the library with malloc; destruct frees the data,
        // free the struct.
        unsafe {
            (self.api.value_destruct)(self.value);
            libc::free(self.value.cast::<c_void>());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// The folder of Debian's libpmix-dev headers.
    const HEADERS: &str = "/usr/lib/x86_64-linux-gnu/pmix2/include";

    #[test]
    #[cfg_attr(
        pindown_no_pmix_headers,
        ignore = "no PMIx headers (Debian libpmix-dev, pulled in by libopenmpi-dev) or no cc; under CI=true this test runs and fails instead"
    )]
    fn layouts_and_constants_match_the_installed_headers() {
        let dir = std::env::temp_dir().join(format!("pindown-pmix-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("layout.c");
        std::fs::write(
            &source,
            r#"#include <stdio.h>
#include <stddef.h>
#include <pmix.h>
int main(void) {
    printf("proc %zu %zu %zu\n", sizeof(pmix_proc_t), _Alignof(pmix_proc_t), offsetof(pmix_proc_t, rank));
    printf("value %zu %zu %zu %zu\n", sizeof(pmix_value_t), _Alignof(pmix_value_t), offsetof(pmix_value_t, data), sizeof(pmix_data_type_t));
    printf("info %zu %zu %zu %zu\n", sizeof(pmix_info_t), _Alignof(pmix_info_t), offsetof(pmix_info_t, flags), offsetof(pmix_info_t, value));
    printf("byte_object %zu %zu\n", sizeof(pmix_byte_object_t), offsetof(pmix_byte_object_t, size));
    printf("scope %zu %d\n", sizeof(pmix_scope_t), (int)PMIX_GLOBAL);
    printf("lengths %d %d\n", PMIX_MAX_NSLEN, PMIX_MAX_KEYLEN);
    printf("ranks %u %d %d\n", (unsigned)PMIX_RANK_WILDCARD, PMIX_SUCCESS, PMIX_ERR_NOT_FOUND);
    printf("types %d %d %d %d %d\n", PMIX_BOOL, PMIX_UINT16, PMIX_UINT32, PMIX_BYTE_OBJECT, PMIX_PROC_RANK);
    printf("keys %s %s %s %s %s\n", PMIX_COLLECT_DATA, PMIX_JOB_SIZE, PMIX_LOCAL_RANK, PMIX_LOCAL_SIZE, PMIX_OPTIONAL);
    return 0;
}
"#,
        )
        .unwrap();
        let binary = dir.join("layout");
        let built = std::process::Command::new("cc")
            .arg(format!("-I{HEADERS}"))
            .arg("-o")
            .arg(&binary)
            .arg(&source)
            .output()
            .expect("cc runs");
        assert!(
            built.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&built.stderr)
        );
        let output = std::process::Command::new(&binary).output().unwrap();
        let c = String::from_utf8(output.stdout).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let rust = [
            format!(
                "proc {} {} {}",
                size_of::<Proc>(),
                align_of::<Proc>(),
                offset_of!(Proc, rank)
            ),
            format!(
                "value {} {} {} {}",
                size_of::<Value>(),
                align_of::<Value>(),
                offset_of!(Value, data),
                size_of::<u16>()
            ),
            format!(
                "info {} {} {} {}",
                size_of::<Info>(),
                align_of::<Info>(),
                offset_of!(Info, flags),
                offset_of!(Info, value)
            ),
            format!(
                "byte_object {} {}",
                size_of::<ByteObject>(),
                offset_of!(ByteObject, size)
            ),
            format!("scope {} {}", size_of::<u8>(), SCOPE_GLOBAL),
            format!("lengths {MAX_NSLEN} {MAX_KEYLEN}"),
            format!("ranks {RANK_WILDCARD} {SUCCESS} {ERR_NOT_FOUND}"),
            format!(
                "types {TYPE_BOOL} {TYPE_UINT16} {TYPE_UINT32} {TYPE_BYTE_OBJECT} {TYPE_PROC_RANK}"
            ),
            format!(
                "keys {} {} {} {} {}",
                KEY_COLLECT_DATA.to_str().unwrap(),
                KEY_JOB_SIZE.to_str().unwrap(),
                KEY_LOCAL_RANK.to_str().unwrap(),
                KEY_LOCAL_SIZE.to_str().unwrap(),
                KEY_OPTIONAL.to_str().unwrap()
            ),
        ];
        let c: Vec<&str> = c.lines().collect();
        assert_eq!(c, rust.iter().map(String::as_str).collect::<Vec<_>>());
    }

    #[test]
    fn a_library_that_is_not_there_is_a_clear_error() {
        let error = Api::load("/nonexistent/libpmix-missing.so.2")
            .err()
            .expect("no such library");
        assert!(
            error.contains("/nonexistent/libpmix-missing.so.2"),
            "{error}"
        );
    }
}
