-- pgcascade.queue_part_name(queue_id, slot) -> the partition of pgcascade.event for that slot.
-- Partition numbers are queue_id * 16 + slot, so a queue owns the range [id*16, id*16 + 16).
create or replace function pgcascade.queue_part_name(i_queue_id int4, i_slot int4) returns text
language sql immutable as $$ select format('event_%s_%s', i_queue_id, i_slot) $$;

-- pgcascade.queue_ensure_parts(queue_id, ntables): create the missing partitions.
-- Each is created standalone and then ATTACHed: ATTACH takes only SHARE UPDATE EXCLUSIVE on
-- the parent, so inserts into other queues never wait behind a create_queue.
-- Autovacuum is off for them, as PgQ does: they are only inserted into and truncated, and an
-- autovacuum holding a partition would make rotation wait (its lock_timeout is shorter than
-- the deadlock_timeout after which a waiting lock cancels autovacuum).
create or replace function pgcascade.queue_ensure_parts(i_queue_id int4, i_ntables int4) returns void
language plpgsql as $$
declare
    k int4;
    part text;
begin
    for k in 0 .. i_ntables - 1 loop
        part := pgcascade.queue_part_name(i_queue_id, k);
        if to_regclass('pgcascade.' || quote_ident(part)) is null then
            execute format('create table pgcascade.%I (like pgcascade.event including defaults)'
                           ' with (autovacuum_enabled = off, toast.autovacuum_enabled = off)', part);
            execute format('alter table pgcascade.event attach partition pgcascade.%I for values in (%s)',
                           part, i_queue_id * 16 + k);
        end if;
    end loop;
end $$;
