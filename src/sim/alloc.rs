//! The CUDA caching allocator, as far as lifetimes need it (c10/cuda/CUDACachingAllocator.cpp):
//! per-stream pools, best-fit with splitting and merging, segments rounded like the real one,
//! and `record_stream` blocks that stay pending until the events recorded at free time have
//! completed *and* a later malloc polls them. `Mode::NoCaching` returns every free at once and
//! never reuses an address: the liveness lower bound.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// Allocator behaviour.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The caching allocator.
    Caching,
    /// No caching: frees return at once, addresses are never reused.
    NoCaching,
}

impl Mode {
    /// Parse a mode name.
    pub fn parse(s: &str) -> crate::Result<Mode> {
        match s {
            "caching" => Ok(Mode::Caching),
            "no_caching" => Ok(Mode::NoCaching),
            other => Err(crate::Error::InvalidInput(format!(
                "unknown allocator mode '{other}': expected caching or no_caching"
            ))),
        }
    }
}

const SMALL: u64 = 1 << 20;
const SMALL_SEGMENT: u64 = 2 << 20;
const MID_SEGMENT: u64 = 20 << 20;
const MID_LIMIT: u64 = 10 << 20;
const ROUND: u64 = 2 << 20;

fn round_request(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(512) * 512
}

fn segment_size(size: u64) -> u64 {
    if size <= SMALL {
        SMALL_SEGMENT
    } else if size < MID_LIMIT {
        MID_SEGMENT
    } else {
        size.div_ceil(ROUND) * ROUND
    }
}

#[derive(Copy, Clone, Debug, PartialEq)]
enum State {
    Free,
    Allocated,
    /// Freed with record_stream uses: reusable once `ready_at` has passed and a malloc polls.
    Pending { ready_at: f64 },
}

#[derive(Clone, Debug)]
struct Block {
    size: u64,
    state: State,
}

struct Segment {
    stream: u16,
    small: bool,
    base: u64,
    size: u64,
    blocks: BTreeMap<u64, Block>,
}

/// Free blocks of one pool, best fit first: (size, segment, offset).
type FreeList = BTreeSet<(u64, u32, u64)>;

/// Where an allocation landed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Segment index.
    pub segment: u32,
    /// Offset in the segment.
    pub offset: u64,
    /// Global address (segment base + offset).
    pub addr: u64,
    /// Rounded size.
    pub size: u64,
}

/// The allocator state and its byte counters.
pub struct Allocator {
    mode: Mode,
    segments: Vec<Segment>,
    /// Free blocks per (stream, small pool): (size, segment, offset), best fit first.
    free: BTreeMap<(u16, bool), FreeList>,
    /// Pending blocks, earliest `ready_at` first: (ready_at bits, segment, offset).
    pending: BinaryHeap<Reverse<(u64, u32, u64)>>,
    next_base: u64,
    /// Bytes in allocated blocks.
    pub allocated: u64,
    /// Bytes in segments.
    pub reserved: u64,
    /// Bytes freed but waiting on record_stream events.
    pub pending_bytes: u64,
}

impl Allocator {
    /// An empty allocator.
    pub fn new(mode: Mode) -> Self {
        Allocator {
            mode,
            segments: Vec::new(),
            free: BTreeMap::new(),
            pending: BinaryHeap::new(),
            next_base: 1 << 32,
            allocated: 0,
            reserved: 0,
            pending_bytes: 0,
        }
    }

    /// Blocks waiting on record_stream events.
    pub fn pending_blocks(&self) -> u64 {
        self.pending.len() as u64
    }

    /// Return pending blocks whose events completed by `now` to their pools (the malloc poll).
    fn poll(&mut self, now: f64) {
        while let Some(&Reverse((t, seg, off))) = self.pending.peek() {
            if f64::from_bits(t) > now {
                break;
            }
            self.pending.pop();
            self.pending_bytes -= self.segments[seg as usize].blocks[&off].size;
            self.release(seg, off);
        }
    }

    /// Allocate `bytes` for use on `stream` at host time `now`.
    pub fn malloc(&mut self, stream: u16, bytes: u64, now: f64) -> Placement {
        let size = round_request(bytes);
        if self.mode == Mode::NoCaching {
            let addr = self.next_base;
            self.next_base += size;
            self.allocated += size;
            self.reserved += size;
            return Placement { segment: u32::MAX, offset: 0, addr, size };
        }
        self.poll(now);
        let small = size <= SMALL;
        let pool = self.free.entry((stream, small)).or_default();
        let found = pool.range((size, 0, 0)..).next().copied();
        let (seg, off, bsize) = match found {
            Some(k @ (bsize, seg, off)) => {
                pool.remove(&k);
                (seg, off, bsize)
            }
            None => {
                let ssize = segment_size(size);
                let seg = self.segments.len() as u32;
                let mut blocks = BTreeMap::new();
                blocks.insert(0, Block { size: ssize, state: State::Free });
                self.segments.push(Segment { stream, small, base: self.next_base, size: ssize, blocks });
                self.next_base += ssize.div_ceil(ROUND) * ROUND;
                self.reserved += ssize;
                (seg, 0, ssize)
            }
        };
        let remaining = bsize - size;
        let split = if small { remaining >= 512 } else { remaining > SMALL };
        let segm = &mut self.segments[seg as usize];
        let taken = if split { size } else { bsize };
        segm.blocks.insert(off, Block { size: taken, state: State::Allocated });
        if split {
            segm.blocks.insert(off + size, Block { size: remaining, state: State::Free });
            self.free.entry((stream, small)).or_default().insert((remaining, seg, off + size));
        }
        self.allocated += taken;
        Placement { segment: seg, offset: off, addr: segm.base + off, size: taken }
    }

    /// Free a block. With `ready_at` (the latest record_stream event), it stays pending.
    pub fn free(&mut self, p: Placement, ready_at: Option<f64>) {
        self.allocated -= p.size;
        if self.mode == Mode::NoCaching {
            self.reserved -= p.size;
            return;
        }
        match ready_at {
            Some(t) => {
                if let Some(b) = self.segments[p.segment as usize].blocks.get_mut(&p.offset) {
                    b.state = State::Pending { ready_at: t };
                }
                // Non-negative f64s order like their bit patterns.
                self.pending.push(Reverse((t.max(0.0).to_bits(), p.segment, p.offset)));
                self.pending_bytes += p.size;
            }
            None => self.release(p.segment, p.offset),
        }
    }

    /// Make a block free, merging with free neighbours of its segment.
    fn release(&mut self, seg: u32, off: u64) {
        let segm = &mut self.segments[seg as usize];
        let pool = self.free.entry((segm.stream, segm.small)).or_default();
        let mut start = off;
        let mut size = segm.blocks[&off].size;
        if let Some((&poff, pb)) = segm.blocks.range(..off).next_back() {
            if pb.state == State::Free && poff + pb.size == off {
                pool.remove(&(pb.size, seg, poff));
                start = poff;
                size += pb.size;
                segm.blocks.remove(&off);
            }
        }
        let next = start + size;
        if let Some(nb) = segm.blocks.get(&next) {
            if nb.state == State::Free {
                pool.remove(&(nb.size, seg, next));
                size += nb.size;
                segm.blocks.remove(&next);
            }
        }
        debug_assert!(start + size <= segm.size);
        segm.blocks.insert(start, Block { size, state: State::Free });
        pool.insert((size, seg, start));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_stream_free_is_reused_at_once_other_stream_is_not() {
        let mut a = Allocator::new(Mode::Caching);
        let p = a.malloc(0, 64 << 20, 0.0);
        a.free(p, None);
        assert_eq!(a.malloc(0, 64 << 20, 1.0).addr, p.addr);
        let q = a.malloc(1, 64 << 20, 2.0);
        assert_ne!(q.addr, p.addr);
        assert_eq!(a.reserved, 128 << 20);
    }

    #[test]
    fn pending_block_reused_only_after_event_and_poll() {
        let mut a = Allocator::new(Mode::Caching);
        let p = a.malloc(0, 64 << 20, 0.0);
        a.free(p, Some(10.0));
        assert_eq!(a.pending_bytes, 64 << 20);
        let q = a.malloc(0, 64 << 20, 5.0); // event not done: a new segment
        assert_ne!(q.addr, p.addr);
        let r = a.malloc(0, 64 << 20, 11.0); // polled: reused
        assert_eq!(r.addr, p.addr);
        assert_eq!(a.pending_bytes, 0);
    }

    #[test]
    fn split_and_merge() {
        let mut a = Allocator::new(Mode::Caching);
        let p = a.malloc(0, 100 << 20, 0.0);
        a.free(p, None);
        let x = a.malloc(0, 30 << 20, 0.0);
        let y = a.malloc(0, 30 << 20, 0.0);
        assert_eq!((x.addr, y.addr), (p.addr, p.addr + (30 << 20)));
        a.free(x, None);
        a.free(y, None);
        assert_eq!(a.malloc(0, 100 << 20, 0.0).addr, p.addr, "merged back into one block");
        assert_eq!(a.reserved, 100 << 20);
    }

    #[test]
    fn no_caching_never_reuses() {
        let mut a = Allocator::new(Mode::NoCaching);
        let p = a.malloc(0, 1000, 0.0);
        a.free(p, None);
        assert_ne!(a.malloc(0, 1000, 0.0).addr, p.addr);
        assert_eq!(a.reserved, 1024);
    }
}
