-- Figures for monitoring (status, the live page, /metrics).  Read-only.

-- pgcascade.queue_retained(queue) -> what the queue holds for its slowest consumer:
--   events        events between the oldest and the newest tick kept (from the ticks' event
--                 sequence positions: no scan of the events)
--   bytes         the size on disk of the queue's event partitions
--   oldest_tick_time  when the oldest tick kept was taken
create or replace function pgcascade.queue_retained(
    i_queue_name text, out events int8, out bytes int8, out oldest_tick_time timestamptz)
language plpgsql stable as $$
declare
    qid int4;
begin
    select queue_id into qid from pgcascade.queue where queue_name = i_queue_name;
    if not found then
        raise exception 'queue "%" does not exist', i_queue_name using errcode = 'P0002';
    end if;
    select greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0) - f.tick_event_seq, 0),
           f.tick_time
      into events, oldest_tick_time
      from pgcascade.queue q
      left join lateral (select * from pgcascade.tick where tick_queue = q.queue_id
                          order by tick_id limit 1) f on true
     where q.queue_id = qid;
    select coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 into bytes
      from pg_inherits i join pg_class c on c.oid = i.inhrelid
     where i.inhparent = 'pgcascade.event'::regclass
       and c.relname like format('event\_%s\_%%', qid);
end $$;

-- pgcascade.pending_by_table(queue, after_tick) -> per table, the row events committed after
-- the tick (not visible in its snapshot) that a consumer at that tick has still to apply:
--   table_name, events, oldest (the ev_time of the oldest: how late that table is in time).
-- The same two index range scans on ev_txid as a batch, so the cost is that of reading the
-- consumer's backlog once; the callers ask at most once per refresh.
create or replace function pgcascade.pending_by_table(
    i_queue_name text, i_after_tick int8, out table_name text, out events int8, out oldest timestamptz)
returns setof record
language plpgsql stable as $$
declare
    h record;
begin
    select * into h from pgcascade.tick_horizon(i_queue_name, i_after_tick);
    return query
        select e.ev_extra1, count(*)::int8, min(e.ev_time)
          from (select ev_extra1, ev_time from pgcascade.event
                 where ev_part >= h.queue_id * 16 and ev_part < h.queue_id * 16 + 16
                   and ev_txid >= h.xmax
                   and ev_type in ('I', 'U', 'D', 'R') and ev_extra1 is not null
                union all
                select ev_extra1, ev_time from pgcascade.event
                 where ev_part >= h.queue_id * 16 and ev_part < h.queue_id * 16 + 16
                   and ev_txid = any(h.xip)
                   and ev_type in ('I', 'U', 'D', 'R') and ev_extra1 is not null) e
         group by e.ev_extra1;
end $$;
