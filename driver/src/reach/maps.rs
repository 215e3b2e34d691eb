//! What is mapped where in this process: the kernel's list of mappings
//! (VMAs), as `/proc/self/maps` shows it.
//!
//! Lookups go through the `PROCMAP_QUERY` ioctl on an open
//! `/proc/self/maps` (Linux 6.11): one system call finds the mapping that
//! holds an address, with its protection, sharing, file offset and file
//! (device and inode), without formatting the whole list as text. Where the
//! kernel lacks it, the text is read and parsed instead, with the same
//! results.

use std::fs::File;
use std::io::{self, Read, Seek};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// A file, as the kernel names it: device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    /// `st_dev` (as `makedev(major, minor)`).
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

impl FileId {
    /// The file behind an open descriptor.
    pub fn of(file: &File) -> io::Result<FileId> {
        Self::of_fd(file.as_fd())
    }

    /// The file behind a descriptor.
    pub fn of_fd(fd: BorrowedFd<'_>) -> io::Result<FileId> {
        // SAFETY: a zeroed stat is a valid value for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat writes into `st` and only reads the descriptor.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(FileId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// One mapping (VMA) of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub start: usize,
    /// One past the last address.
    pub end: usize,
    /// Readable.
    pub read: bool,
    /// Writable.
    pub write: bool,
    /// Executable.
    pub exec: bool,
    /// `MAP_SHARED` (else private: copy-on-write).
    pub shared: bool,
    /// Offset in the file of `start` (0 without a file).
    pub offset: u64,
    /// The file mapped, if any (shared anonymous memory is a file of the
    /// kernel's internal tmpfs).
    pub file: Option<FileId>,
}

impl Mapping {
    /// Offset in the file of `addr` (inside the mapping).
    pub fn offset_of(&self, addr: usize) -> u64 {
        self.offset + (addr - self.start) as u64
    }

    /// The `PROT_*` bits of the mapping.
    pub fn prot(&self) -> libc::c_int {
        let mut prot = libc::PROT_NONE;
        if self.read {
            prot |= libc::PROT_READ;
        }
        if self.write {
            prot |= libc::PROT_WRITE;
        }
        if self.exec {
            prot |= libc::PROT_EXEC;
        }
        prot
    }
}

/// `struct procmap_query` (linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
const VMA_READABLE: u64 = 0x01;
const VMA_WRITABLE: u64 = 0x02;
const VMA_EXECUTABLE: u64 = 0x04;
const VMA_SHARED: u64 = 0x08;
/// Query flag: the mapping at the address, or else the next one above it.
const COVERING_OR_NEXT_VMA: u64 = 0x10;
/// Query flag: only mappings of files.
const FILE_BACKED_VMA: u64 = 0x20;

/// This process's mappings.
#[derive(Debug)]
pub struct Maps {
    file: File,
    /// Whether the kernel answers `PROCMAP_QUERY`.
    query: bool,
}

impl Maps {
    /// Opens `/proc/self/maps` (of the process, whichever thread asks).
    pub fn open() -> io::Result<Maps> {
        let file = File::open("/proc/self/maps")?;
        let mut maps = Maps { file, query: true };
        let probe = &maps as *const Maps as usize;
        maps.query = match maps.query(probe, 0) {
            Ok(_) => true,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => false,
            Err(e) => return Err(e),
        };
        Ok(maps)
    }

    /// The mapping that holds `addr`, if any.
    pub fn at(&self, addr: usize) -> io::Result<Option<Mapping>> {
        if self.query {
            return self.query(addr, 0);
        }
        Ok(self
            .parse_all()?
            .into_iter()
            .find(|m| m.start <= addr && addr < m.end))
    }

    /// Every mapping of a file, in address order.
    pub fn file_backed(&self) -> io::Result<Vec<Mapping>> {
        if !self.query {
            return Ok(self
                .parse_all()?
                .into_iter()
                .filter(|m| m.file.is_some())
                .collect());
        }
        let mut out = Vec::new();
        let mut cursor = 0usize;
        while let Some(mapping) = self.query(cursor, COVERING_OR_NEXT_VMA | FILE_BACKED_VMA)? {
            cursor = mapping.end;
            out.push(mapping);
        }
        Ok(out)
    }

    /// The name `/proc/self/maps` shows for the mapping at `addr` (a path,
    /// with " (deleted)" for an unlinked file), if it has one.
    pub fn name_at(&self, addr: usize) -> Option<String> {
        if self.query {
            let mut name = vec![0u8; libc::PATH_MAX as usize + 16];
            let mut q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_addr: addr as u64,
                vma_name_size: name.len() as u32,
                vma_name_addr: name.as_mut_ptr() as u64,
                ..Default::default()
            };
            // SAFETY: PROCMAP_QUERY reads and writes one ProcmapQuery we
            // own and writes at most `vma_name_size` bytes into `name`,
            // which outlives the call.
            if unsafe { libc::ioctl(self.file.as_raw_fd(), PROCMAP_QUERY, &mut q) } != 0 {
                return None;
            }
            let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
            return (len > 0).then(|| String::from_utf8_lossy(&name[..len]).into_owned());
        }
        let text = self.read_text().ok()?;
        text.lines().find_map(|line| {
            let (mapping, name) = parse_line(line)?;
            (mapping.start <= addr && addr < mapping.end && !name.is_empty())
                .then(|| name.to_owned())
        })
    }

    fn query(&self, addr: usize, flags: u64) -> io::Result<Option<Mapping>> {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: flags,
            query_addr: addr as u64,
            ..Default::default()
        };
        // SAFETY: PROCMAP_QUERY reads and writes one ProcmapQuery we own;
        // no name or build id is asked for, so nothing else is written.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), PROCMAP_QUERY, &mut q) } != 0 {
            let error = io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(error),
            };
        }
        let file = (q.inode != 0).then(|| FileId {
            dev: libc::makedev(q.dev_major, q.dev_minor),
            ino: q.inode,
        });
        Ok(Some(Mapping {
            start: q.vma_start as usize,
            end: q.vma_end as usize,
            read: q.vma_flags & VMA_READABLE != 0,
            write: q.vma_flags & VMA_WRITABLE != 0,
            exec: q.vma_flags & VMA_EXECUTABLE != 0,
            shared: q.vma_flags & VMA_SHARED != 0,
            offset: if file.is_some() { q.vma_offset } else { 0 },
            file,
        }))
    }

    fn read_text(&self) -> io::Result<String> {
        let mut file = &self.file;
        file.rewind()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        Ok(text)
    }

    fn parse_all(&self) -> io::Result<Vec<Mapping>> {
        let text = self.read_text()?;
        Ok(text
            .lines()
            .filter_map(|line| parse_line(line).map(|(m, _)| m))
            .collect())
    }
}

/// Parses one line of `/proc/<pid>/maps`:
/// `start-end perms offset major:minor inode [name]`, numbers in hex but
/// the inode (decimal). Returns the mapping and its name (empty if none).
pub fn parse_line(line: &str) -> Option<(Mapping, &str)> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let inode: u64 = fields.next()?.parse().ok()?;
    let name = fields.next().unwrap_or("").trim_start();
    if perms.len() < 4 {
        return None;
    }
    let file = (inode != 0).then_some(FileId {
        dev: libc::makedev(
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        ino: inode,
    });
    Some((
        Mapping {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            read: perms[0] == b'r',
            write: perms[1] == b'w',
            exec: perms[2] == b'x',
            shared: perms[3] == b's',
            offset: if file.is_some() { offset } else { 0 },
            file,
        },
        name,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_as_the_kernel_writes_them() {
        let (m, name) = parse_line(
            "7f12a4000000-7f12a4021000 rw-s 00003000 00:01 1081                       /memfd:pool (deleted)",
        )
        .unwrap();
        assert_eq!(m.start, 0x7f12_a400_0000);
        assert_eq!(m.end, 0x7f12_a402_1000);
        assert!(m.read && m.write && !m.exec && m.shared);
        assert_eq!(m.offset, 0x3000);
        assert_eq!(
            m.file,
            Some(FileId {
                dev: libc::makedev(0, 1),
                ino: 1081
            })
        );
        assert_eq!(name, "/memfd:pool (deleted)");
        let (heap, name) =
            parse_line("55d0c8a1e000-55d0c8a3f000 rw-p 00000000 00:00 0   [heap]").unwrap();
        assert!(!heap.shared && heap.file.is_none());
        assert_eq!(name, "[heap]");
        let (anon, name) = parse_line("7ffd1c000000-7ffd1c001000 r--p 00000000 00:00 0").unwrap();
        assert!(anon.read && !anon.write);
        assert_eq!(name, "");
        for bad in [
            "",
            "zz-1 rw-p 0 00:00 0",
            "1-2 rw 0 00:00 0",
            "1-2 rw-p 0 0000 0",
        ] {
            assert!(parse_line(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_query_and_the_text_agree() {
        let maps = Maps::open().unwrap();
        let text = Maps {
            file: File::open("/proc/self/maps").unwrap(),
            query: false,
        };
        let heap = vec![0u8; 1 << 20];
        let local = 0u64;
        for addr in [
            heap.as_ptr() as usize,
            &local as *const u64 as usize,
            Maps::open as *const () as usize,
        ] {
            assert_eq!(maps.at(addr).unwrap(), text.at(addr).unwrap(), "{addr:#x}");
        }
        assert_eq!(maps.at(8).unwrap(), None, "nothing is mapped at 8");
        let by_query = maps.file_backed().unwrap();
        assert!(!by_query.is_empty());
        assert!(by_query.iter().all(|m| m.file.is_some()));
        let name = maps.name_at(Maps::open as *const () as usize).unwrap();
        assert_eq!(
            text.name_at(Maps::open as *const () as usize).unwrap(),
            name
        );
    }
}
