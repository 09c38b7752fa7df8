//! Hand-built netlink messages: rtnetlink (links, addresses, routes, neighbours) and the
//! two netfilter requests agentenv needs (conntrack flush, nf_tables dumps).
//!
//! A [`NetlinkSocket`] stays bound to the network namespace it was opened in, which is how
//! slot namespaces are configured without the calling thread ever entering them.

use super::{check, SysError, SysResult};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

// Netlink header values (linux/netlink.h).
const NLM_F_REQUEST: u16 = 0x01;
const NLM_F_MULTI: u16 = 0x02;
const NLM_F_ACK: u16 = 0x04;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLA_F_NESTED: u16 = 0x8000;

// rtnetlink (linux/rtnetlink.h, if_link.h, if_addr.h, neighbour.h, veth.h).
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWNEIGH: u16 = 28;
const RTM_DELNEIGH: u16 = 29;
const RTM_GETNEIGH: u16 = 30;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PREFSRC: u16 = 7;
const RTA_TABLE: u16 = 15;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RTN_UNICAST: u8 = 1;
const IFF_UP: u32 = 0x1;
/// Neighbour state of an entry that never expires (`NUD_PERMANENT`).
pub const NUD_PERMANENT: u16 = 0x80;
/// Neighbour state of an entry that needs no resolution (`NUD_NOARP`).
pub const NUD_NOARP: u16 = 0x40;

// nfnetlink (linux/netfilter/nfnetlink.h, nf_conntrack_netlink.h, nf_tables.h).
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
/// `NFT_MSG_GETTABLE`.
pub const NFT_MSG_GETTABLE: u16 = 1;
/// `NFT_MSG_GETCHAIN`.
pub const NFT_MSG_GETCHAIN: u16 = 4;
/// `NFT_MSG_GETRULE`.
pub const NFT_MSG_GETRULE: u16 = 7;
/// `NFT_MSG_GETSET`.
pub const NFT_MSG_GETSET: u16 = 10;

const HDR_LEN: usize = 16;
const RECV_BUF: usize = 64 * 1024;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A netlink request under construction: header, fixed family header, attributes.
pub struct Message {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Message {
    pub fn new(msg_type: u16, flags: u16) -> Message {
        let mut buf = vec![0u8; HDR_LEN];
        buf[4..6].copy_from_slice(&msg_type.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        Message {
            buf,
            nests: Vec::new(),
        }
    }

    /// Appends raw bytes (a family header such as `ifinfomsg`), padded to 4 bytes.
    pub fn push(&mut self, bytes: &[u8]) -> &mut Message {
        self.buf.extend_from_slice(bytes);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    pub fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Message {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.push(data)
    }

    pub fn attr_u32(&mut self, ty: u16, v: u32) -> &mut Message {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A NUL-terminated string attribute.
    pub fn attr_str(&mut self, ty: u16, s: &str) -> &mut Message {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v)
    }

    pub fn begin_nest(&mut self, ty: u16) -> &mut Message {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn end_nest(&mut self) -> &mut Message {
        let start = self.nests.pop().expect("end_nest without begin_nest");
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    fn finish(&mut self, seq: u32) -> &[u8] {
        debug_assert!(self.nests.is_empty());
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

/// Iterates `(type, payload)` over a block of netlink attributes.
pub fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        let ty = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            return None;
        }
        let payload = &data[4..len];
        data = &data[align4(len).min(data.len())..];
        Some((ty, payload))
    })
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map(|s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
        .unwrap_or(0)
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn ifinfomsg(index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0] = libc::AF_UNSPEC as u8;
    h[4..8].copy_from_slice(&index.to_ne_bytes());
    h[8..12].copy_from_slice(&flags.to_ne_bytes());
    h[12..16].copy_from_slice(&change.to_ne_bytes());
    h
}

fn nfgenmsg(family: u8) -> [u8; 4] {
    [family, 0, 0, 0]
}

/// One network interface, as listed by [`NetlinkSocket::links`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub index: u32,
    pub name: String,
}

/// One address, as listed by [`NetlinkSocket::addresses`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AddrInfo {
    pub family: u8,
    pub index: u32,
    pub prefix: u8,
    pub local: Vec<u8>,
}

/// The identifying fields of one route (flags such as `linkdown` left out on purpose:
/// they follow the carrier of `tap0`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RouteInfo {
    pub family: u8,
    pub table: u32,
    pub dst_len: u8,
    pub protocol: u8,
    pub scope: u8,
    pub kind: u8,
    pub dst: Vec<u8>,
    pub gateway: Vec<u8>,
    pub oif: u32,
    pub prefsrc: Vec<u8>,
}

/// One neighbour entry, as listed by [`NetlinkSocket::neighbours`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NeighInfo {
    pub family: u8,
    pub index: u32,
    pub state: u16,
    pub dst: Vec<u8>,
    pub lladdr: Vec<u8>,
}

/// A bound netlink socket of one protocol, in the namespace it was opened in.
pub struct NetlinkSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl NetlinkSocket {
    /// An rtnetlink socket in the calling thread's network namespace.
    pub fn route() -> SysResult<NetlinkSocket> {
        Self::open(libc::NETLINK_ROUTE, "rtnetlink")
    }

    /// A netfilter (nfnetlink) socket in the calling thread's network namespace.
    pub fn netfilter() -> SysResult<NetlinkSocket> {
        Self::open(libc::NETLINK_NETFILTER, "nfnetlink")
    }

    fn open(protocol: libc::c_int, what: &str) -> SysResult<NetlinkSocket> {
        // SAFETY: plain socket(2) call with constant arguments; the result is checked.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        check(raw, || format!("socket({what})"))?;
        // SAFETY: `raw` is a fresh, valid descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain old data; all-zero is a valid value.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `sa` is a valid sockaddr_nl and its size is passed alongside.
        let ret = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        check(ret, || format!("bind({what})"))?;
        Ok(NetlinkSocket {
            fd,
            seq: 0,
            buf: vec![0u8; RECV_BUF],
        })
    }

    fn send(&mut self, msg: &mut Message, op: &str) -> SysResult<u32> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let bytes = msg.finish(seq);
        // SAFETY: `bytes` is a valid buffer of the given length for the duration of the call.
        let ret = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
                0,
            )
        };
        if ret < 0 {
            return Err(SysError::last(op));
        }
        Ok(seq)
    }

    fn recv(&mut self, op: &str) -> SysResult<usize> {
        loop {
            // SAFETY: `self.buf` is a valid, writable buffer of the given length.
            let ret = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr() as *mut libc::c_void,
                    self.buf.len(),
                    0,
                )
            };
            if ret < 0 {
                let e = SysError::last(op);
                if e.errno() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            return Ok(ret as usize);
        }
    }

    /// Sends a request with `NLM_F_ACK` and waits for the kernel's answer.
    pub fn request(&mut self, msg: &mut Message, op: &str) -> SysResult<()> {
        let flags = u16::from_ne_bytes([msg.buf[6], msg.buf[7]]) | NLM_F_ACK;
        msg.buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        let seq = self.send(msg, op)?;
        loop {
            let n = self.recv(op)?;
            let mut off = 0;
            while off + HDR_LEN <= n {
                let len = u32_at(&self.buf, off) as usize;
                let ty = u16::from_ne_bytes([self.buf[off + 4], self.buf[off + 5]]);
                let mseq = u32_at(&self.buf, off + 8);
                if len < HDR_LEN || off + len > n {
                    break;
                }
                if ty == NLMSG_ERROR && mseq == seq {
                    let err = u32_at(&self.buf, off + HDR_LEN) as i32;
                    return if err == 0 {
                        Ok(())
                    } else {
                        Err(SysError::from_errno(op, -err))
                    };
                }
                off += align4(len);
            }
        }
    }

    /// Sends a dump request and returns each answer message's payload (what follows the
    /// netlink header). An interrupted dump (the set changed meanwhile) is retried.
    pub fn dump(&mut self, msg: &mut Message, op: &str) -> SysResult<Vec<Vec<u8>>> {
        let flags = u16::from_ne_bytes([msg.buf[6], msg.buf[7]]) | NLM_F_DUMP;
        msg.buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        for _ in 0..5 {
            let seq = self.send(msg, op)?;
            let mut out = Vec::new();
            let mut interrupted = false;
            'recv: loop {
                let n = self.recv(op)?;
                let mut off = 0;
                while off + HDR_LEN <= n {
                    let len = u32_at(&self.buf, off) as usize;
                    let ty = u16::from_ne_bytes([self.buf[off + 4], self.buf[off + 5]]);
                    let fl = u16::from_ne_bytes([self.buf[off + 6], self.buf[off + 7]]);
                    let mseq = u32_at(&self.buf, off + 8);
                    if len < HDR_LEN || off + len > n {
                        break;
                    }
                    if mseq == seq {
                        interrupted |= fl & NLM_F_DUMP_INTR != 0;
                        match ty {
                            NLMSG_DONE => break 'recv,
                            NLMSG_ERROR => {
                                let err = u32_at(&self.buf, off + HDR_LEN) as i32;
                                if err != 0 {
                                    return Err(SysError::from_errno(op, -err));
                                }
                                break 'recv;
                            }
                            _ => out.push(self.buf[off + HDR_LEN..off + len].to_vec()),
                        }
                        if fl & NLM_F_MULTI == 0 {
                            break 'recv;
                        }
                    }
                    off += align4(len);
                }
            }
            if !interrupted {
                return Ok(out);
            }
        }
        Err(SysError::from_errno(op, libc::EAGAIN))
    }

    /// Creates the veth pair `name` (here) / `peer` (in the namespace `peer_ns`).
    pub fn create_veth(&mut self, name: &str, peer: &str, peer_ns: BorrowedFd) -> SysResult<()> {
        let mut m = Message::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL);
        m.push(&ifinfomsg(0, 0, 0))
            .attr_str(IFLA_IFNAME, name)
            .begin_nest(IFLA_LINKINFO)
            .attr_str(IFLA_INFO_KIND, "veth")
            .begin_nest(IFLA_INFO_DATA)
            .begin_nest(VETH_INFO_PEER)
            .push(&ifinfomsg(0, 0, 0))
            .attr_str(IFLA_IFNAME, peer)
            .attr_u32(IFLA_NET_NS_FD, peer_ns.as_raw_fd() as u32)
            .end_nest()
            .end_nest()
            .end_nest();
        self.request(&mut m, &format!("create veth {name}"))
    }

    /// Brings the link `name` up and optionally sets its MAC address.
    pub fn set_link_up(&mut self, name: &str, mac: Option<[u8; 6]>) -> SysResult<()> {
        let mut m = Message::new(RTM_NEWLINK, 0);
        m.push(&ifinfomsg(0, IFF_UP, IFF_UP))
            .attr_str(IFLA_IFNAME, name);
        if let Some(mac) = mac {
            m.attr(IFLA_ADDRESS, &mac);
        }
        self.request(&mut m, &format!("set link {name} up"))
    }

    /// Deletes the link `name`. Returns `false` when it did not exist.
    pub fn delete_link(&mut self, name: &str) -> SysResult<bool> {
        let mut m = Message::new(RTM_DELLINK, 0);
        m.push(&ifinfomsg(0, 0, 0)).attr_str(IFLA_IFNAME, name);
        match self.request(&mut m, &format!("delete link {name}")) {
            Ok(()) => Ok(true),
            Err(e) if e.errno() == Some(libc::ENODEV) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The interface index of `name`, if it exists.
    pub fn link_index(&mut self, name: &str) -> SysResult<Option<u32>> {
        let mut m = Message::new(RTM_GETLINK, 0);
        m.push(&ifinfomsg(0, 0, 0)).attr_str(IFLA_IFNAME, name);
        let op = format!("look up link {name}");
        let seq = self.send(&mut m, &op)?;
        loop {
            let n = self.recv(&op)?;
            let mut off = 0;
            while off + HDR_LEN <= n {
                let len = u32_at(&self.buf, off) as usize;
                let ty = u16::from_ne_bytes([self.buf[off + 4], self.buf[off + 5]]);
                if len < HDR_LEN || off + len > n {
                    break;
                }
                if u32_at(&self.buf, off + 8) == seq {
                    if ty == NLMSG_ERROR {
                        let err = -(u32_at(&self.buf, off + HDR_LEN) as i32);
                        return match err {
                            libc::ENODEV => Ok(None),
                            e => Err(SysError::from_errno(op, e)),
                        };
                    }
                    if ty == RTM_NEWLINK {
                        return Ok(Some(u32_at(&self.buf, off + HDR_LEN + 4)));
                    }
                }
                off += align4(len);
            }
        }
    }

    /// Adds an IPv4 address to the interface `index`.
    pub fn add_address(&mut self, index: u32, addr: Ipv4Addr, prefix: u8) -> SysResult<()> {
        let mut h = [0u8; 8];
        h[0] = libc::AF_INET as u8;
        h[1] = prefix;
        h[4..8].copy_from_slice(&index.to_ne_bytes());
        let mut m = Message::new(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL);
        m.push(&h)
            .attr(IFA_LOCAL, &addr.octets())
            .attr(IFA_ADDRESS, &addr.octets());
        self.request(&mut m, &format!("add address {addr}/{prefix}"))
    }

    /// Adds an IPv4 route in the main table.
    pub fn add_route(
        &mut self,
        dst: Ipv4Addr,
        dst_len: u8,
        gateway: Option<Ipv4Addr>,
        oif: u32,
        prefsrc: Option<Ipv4Addr>,
    ) -> SysResult<()> {
        let mut h = [0u8; 12];
        h[0] = libc::AF_INET as u8;
        h[1] = dst_len;
        h[4] = RT_TABLE_MAIN;
        h[5] = RTPROT_STATIC;
        h[6] = RT_SCOPE_UNIVERSE;
        h[7] = RTN_UNICAST;
        let mut m = Message::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL);
        m.push(&h);
        if dst_len > 0 {
            m.attr(RTA_DST, &dst.octets());
        }
        if let Some(gw) = gateway {
            m.attr(RTA_GATEWAY, &gw.octets());
        }
        m.attr_u32(RTA_OIF, oif);
        if let Some(src) = prefsrc {
            m.attr(RTA_PREFSRC, &src.octets());
        }
        self.request(&mut m, &format!("add route {dst}/{dst_len}"))
    }

    /// Adds a permanent IPv4 neighbour entry.
    pub fn add_permanent_neighbour(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        mac: [u8; 6],
    ) -> SysResult<()> {
        let mut m = Message::new(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_EXCL);
        m.push(&ndmsg(libc::AF_INET as u8, index, NUD_PERMANENT))
            .attr(NDA_DST, &ip.octets())
            .attr(NDA_LLADDR, &mac);
        self.request(&mut m, &format!("add neighbour {ip}"))
    }

    /// Deletes one neighbour entry (missing ones are ignored).
    pub fn delete_neighbour(&mut self, n: &NeighInfo) -> SysResult<()> {
        let mut m = Message::new(RTM_DELNEIGH, 0);
        m.push(&ndmsg(n.family, n.index, 0)).attr(NDA_DST, &n.dst);
        match self.request(&mut m, "delete neighbour") {
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }

    pub fn links(&mut self) -> SysResult<Vec<LinkInfo>> {
        let mut m = Message::new(RTM_GETLINK, 0);
        m.push(&ifinfomsg(0, 0, 0));
        let msgs = self.dump(&mut m, "list links")?;
        Ok(msgs
            .iter()
            .filter(|p| p.len() >= 16)
            .map(|p| LinkInfo {
                index: u32_at(p, 4),
                name: attrs(&p[16..])
                    .find(|(t, _)| *t == IFLA_IFNAME)
                    .map(|(_, v)| c_string(v))
                    .unwrap_or_default(),
            })
            .collect())
    }

    pub fn addresses(&mut self) -> SysResult<Vec<AddrInfo>> {
        let mut m = Message::new(RTM_GETADDR, 0);
        m.push(&[0u8; 8]);
        let msgs = self.dump(&mut m, "list addresses")?;
        Ok(msgs
            .iter()
            .filter(|p| p.len() >= 8)
            .map(|p| {
                let mut local = Vec::new();
                for (t, v) in attrs(&p[8..]) {
                    if t == IFA_LOCAL || (t == IFA_ADDRESS && local.is_empty()) {
                        local = v.to_vec();
                    }
                }
                AddrInfo {
                    family: p[0],
                    prefix: p[1],
                    index: u32_at(p, 4),
                    local,
                }
            })
            .collect())
    }

    pub fn routes(&mut self) -> SysResult<Vec<RouteInfo>> {
        let mut m = Message::new(RTM_GETROUTE, 0);
        m.push(&[0u8; 12]);
        let msgs = self.dump(&mut m, "list routes")?;
        Ok(msgs
            .iter()
            .filter(|p| p.len() >= 12)
            .map(|p| {
                let mut r = RouteInfo {
                    family: p[0],
                    dst_len: p[1],
                    table: p[4] as u32,
                    protocol: p[5],
                    scope: p[6],
                    kind: p[7],
                    dst: Vec::new(),
                    gateway: Vec::new(),
                    oif: 0,
                    prefsrc: Vec::new(),
                };
                for (t, v) in attrs(&p[12..]) {
                    match t {
                        RTA_DST => r.dst = v.to_vec(),
                        RTA_GATEWAY => r.gateway = v.to_vec(),
                        RTA_OIF => r.oif = u32_at(v, 0),
                        RTA_PREFSRC => r.prefsrc = v.to_vec(),
                        RTA_TABLE => r.table = u32_at(v, 0),
                        _ => {}
                    }
                }
                r
            })
            .collect())
    }

    pub fn neighbours(&mut self) -> SysResult<Vec<NeighInfo>> {
        let mut m = Message::new(RTM_GETNEIGH, 0);
        m.push(&ndmsg(libc::AF_UNSPEC as u8, 0, 0));
        let msgs = self.dump(&mut m, "list neighbours")?;
        Ok(msgs
            .iter()
            .filter(|p| p.len() >= 12)
            .map(|p| {
                let mut n = NeighInfo {
                    family: p[0],
                    index: u32_at(p, 4),
                    state: u16::from_ne_bytes([p[8], p[9]]),
                    dst: Vec::new(),
                    lladdr: Vec::new(),
                };
                for (t, v) in attrs(&p[12..]) {
                    match t {
                        NDA_DST => n.dst = v.to_vec(),
                        NDA_LLADDR => n.lladdr = v.to_vec(),
                        _ => {}
                    }
                }
                n
            })
            .collect())
    }

    /// Empties the IPv4 conntrack table of this socket's namespace (nfnetlink socket).
    pub fn flush_conntrack(&mut self) -> SysResult<()> {
        let mut m = Message::new((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE, 0);
        m.push(&nfgenmsg(libc::AF_INET as u8));
        self.request(&mut m, "flush conntrack")
    }

    /// Dumps one kind of nf_tables object (`NFT_MSG_GET*`) for every family, returning
    /// each object's payload without the `nfgenmsg` header (whose generation id changes
    /// with any ruleset change anywhere in the namespace).
    pub fn nft_dump(&mut self, msg: u16) -> SysResult<Vec<Vec<u8>>> {
        let mut m = Message::new((NFNL_SUBSYS_NFTABLES << 8) | msg, 0);
        m.push(&nfgenmsg(libc::AF_UNSPEC as u8));
        let out = self.dump(&mut m, "list nf_tables objects")?;
        Ok(out
            .into_iter()
            .map(|mut p| {
                let family = p.first().copied().unwrap_or(0);
                p.drain(..4.min(p.len()));
                p.insert(0, family);
                p
            })
            .collect())
    }
}

fn ndmsg(family: u8, index: u32, state: u16) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[0] = family;
    h[4..8].copy_from_slice(&index.to_ne_bytes());
    h[8..10].copy_from_slice(&state.to_ne_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_layout_and_nesting() {
        let mut m = Message::new(RTM_NEWLINK, NLM_F_CREATE);
        m.push(&[1, 2, 3])
            .begin_nest(IFLA_LINKINFO)
            .attr_str(IFLA_INFO_KIND, "veth")
            .end_nest();
        let b = m.finish(7).to_vec();
        assert_eq!(u32_at(&b, 0) as usize, b.len());
        assert_eq!(u32_at(&b, 8), 7);
        assert_eq!(b.len() % 4, 0);
        let body = &b[HDR_LEN + 4..];
        let (t, nest) = attrs(body).next().unwrap();
        assert_eq!(t, IFLA_LINKINFO);
        let (t, v) = attrs(nest).next().unwrap();
        assert_eq!(t, IFLA_INFO_KIND);
        assert_eq!(v, b"veth\0");
    }
}
