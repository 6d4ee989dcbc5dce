-- Logical capture on the root (see migration 0005 and walcapture.py).

-- pgcascade.walcapture_needs_full_identity(table) -> whether pgoutput may leave a column out
-- of an UPDATE ("unchanged TOASTed value"): only values stored out of line are left out, and a
-- row is toasted only when it can grow past ~2 kB.  A table whose widest possible row stays
-- well below that never is; any other needs REPLICA IDENTITY FULL, so that the old row
-- travels with the update and the capture fills the missing value from it.  Bounded widths:
-- fixed-length types, char(n)/varchar(n) (4 bytes a character at most), numeric(p, s).
create or replace function pgcascade.walcapture_needs_full_identity(i_table regclass) returns bool
language sql stable as $$
    select coalesce(bool_or(w is null), false) or coalesce(sum(w), 0) > 1800
      from (select case
                     when a.attlen > 0 then a.attlen + 8
                     when a.atttypid in ('bpchar'::regtype, 'varchar'::regtype) and a.atttypmod > 4
                          then (a.atttypmod - 4) * 4 + 8
                     when a.atttypid = 'numeric'::regtype and a.atttypmod > 4
                          then ((a.atttypmod - 4) >> 16) + 16
                   end as w
              from pg_attribute a
             where a.attrelid = i_table and a.attnum > 0 and not a.attisdropped) c
$$;

-- pgcascade.walcapture_full_identity(table) -> tables set to REPLICA IDENTITY FULL now: the table
-- and, a partitioned one, its partitions (pgoutput logs a partition's old rows by the
-- partition's own identity; those attached later: maint_capture_partitions).
create or replace function pgcascade.walcapture_full_identity(i_table regclass) returns int4
language plpgsql as $$
declare
    r record;
    n int4 := 0;
begin
    for r in select c.oid::regclass as rel from pg_class c
              where (c.oid = i_table or c.oid in (select relid from pg_partition_tree(i_table)))
                and c.relkind in ('r', 'p') and c.relreplident <> 'f' loop
        execute format('alter table %s replica identity full', r.rel);
        n := n + 1;
    end loop;
    return n;
end $$;

-- pgcascade.walcapture_add_table(queue, table, key_columns) -> the replica identity set
-- ('default' or 'full').  Adds the table to the queue's publication.  REPLICA IDENTITY FULL is
-- set when the key is not the primary key (pgoutput sends the old row's identity columns
-- only) or when an UPDATE could leave a TOASTed value out (see above).
create or replace function pgcascade.walcapture_add_table(i_queue text, i_table regclass, i_keys text[])
returns text
language plpgsql as $$
declare
    w pgcascade.walcapture;
    pk text[];
    v_ident text := 'default';
begin
    select * into w from pgcascade.walcapture where queue_name = i_queue;
    if not found then
        raise exception 'queue "%" does not capture through a slot', i_queue using errcode = '55000';
    end if;
    select array_agg(a.attname::text order by k.ord) into pk
      from pg_index i cross join lateral unnest(i.indkey) with ordinality k(attnum, ord)
      join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum
     where i.indrelid = i_table and i.indisprimary;
    if pk is distinct from i_keys or pgcascade.walcapture_needs_full_identity(i_table)
       or (select relreplident from pg_class where oid = i_table) = 'n' then
        v_ident := 'full';
        perform pgcascade.walcapture_full_identity(i_table);
    end if;
    if not exists (select 1 from pg_publication_rel r join pg_publication p on p.oid = r.prpubid
                    where p.pubname = w.publication and r.prrelid = i_table) then
        execute format('alter publication %I add table %s', w.publication, i_table);
    end if;
    return v_ident;
end $$;

-- pgcascade.walcapture_remove_table(queue, table) -> void: out of the publication (the
-- replica identity stays as it is: it may have been the user's choice).
create or replace function pgcascade.walcapture_remove_table(i_queue text, i_table regclass) returns void
language plpgsql as $$
declare
    w pgcascade.walcapture;
begin
    select * into w from pgcascade.walcapture where queue_name = i_queue;
    if found and exists (select 1 from pg_publication_rel r join pg_publication p on p.oid = r.prpubid
                          where p.pubname = w.publication and r.prrelid = i_table) then
        execute format('alter publication %I drop table %s', w.publication, i_table);
    end if;
end $$;

-- pgcascade.emit_event(queue, type, data, extra1) -> void: an event the root's own commands
-- make (the table list T, EXECUTE).  With trigger capture it goes into the queue at once;
-- with logical capture it goes into the WAL as a transactional logical message, and the
-- capture daemon queues it in order with the row changes around it - inserted directly, it
-- would overtake changes committed before it that the daemon has not read yet.
create or replace function pgcascade.emit_event(i_queue text, i_type text, i_data text, i_extra1 text)
returns void
language plpgsql as $$
begin
    if exists (select 1 from pgcascade.walcapture where queue_name = i_queue) then
        perform pg_logical_emit_message(true, 'pgcascade',
            json_build_object('queue', i_queue, 'type', i_type, 'data', i_data, 'extra1', i_extra1)::text);
    else
        perform pgcascade.insert_event(i_queue, i_type, i_data, i_extra1, null, null, null);
    end if;
end $$;

-- pgcascade.emit_event(queue, type, data, extra1, origin, origin_tick) -> void: the same, for a
-- DDL a two-way master's apply passes on from peer `origin` to the leaves under it: tagged (its
-- peers take no tagged event as a change) and with the tick of the origin's queue that carried
-- it (ev_extra3): a peer that meets it in this master's queue first applies the origin up to
-- there, since this master's changes after it may depend on it.
drop function if exists pgcascade.emit_event(text, text, text, text, text);
create or replace function pgcascade.emit_event(
    i_queue text, i_type text, i_data text, i_extra1 text, i_origin text, i_origin_tick int8)
returns void
language plpgsql as $$
begin
    if exists (select 1 from pgcascade.walcapture where queue_name = i_queue) then
        perform pg_logical_emit_message(true, 'pgcascade',
            json_build_object('queue', i_queue, 'type', i_type, 'data', i_data, 'extra1', i_extra1,
                              'origin', i_origin, 'extra3', i_origin_tick::text)::text);
    else
        perform pgcascade.insert_event(i_queue, i_type, i_data, i_extra1, null, i_origin_tick::text, i_origin);
    end if;
end $$;

-- pgcascade.walcapture_status(queue) -> the slot's state: bytes of WAL it holds back
-- (retained), bytes not captured yet (behind), and the time since the last captured commit.
create or replace function pgcascade.walcapture_status(
    i_queue text,
    out slot_name text, out slot_exists bool, out slot_active bool,
    out retained_bytes int8, out behind_bytes int8, out wal_status text,
    out confirmed_lsn pg_lsn, out last_commit timestamptz, out last_capture timestamptz,
    out last_error text, out last_error_time timestamptz)
language sql stable as $$
    select w.slot_name, s.slot_name is not null, s.active,
           pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::int8,
           pg_wal_lsn_diff(pg_current_wal_lsn(), greatest(w.confirmed_lsn, s.confirmed_flush_lsn))::int8,
           s.wal_status, w.confirmed_lsn, w.last_commit, w.last_capture, w.last_error, w.last_error_time
      from pgcascade.walcapture w
      left join pg_replication_slots s on s.slot_name = w.slot_name
     where w.queue_name = i_queue
$$;
